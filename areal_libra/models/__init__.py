"""Small local models for the embedded CPU default (built offline, cached)."""
