"""The plugin-EP ABI: the only code that touches ORT's C structs."""
