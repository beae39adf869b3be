"""Graph IR, claiming and grouping, plans."""
