"""Translator modules, one per op family; each registers its ops on import."""
