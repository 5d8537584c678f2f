"""Token-in/token-out `POST /generate` (docs/architecture.md §12)."""
