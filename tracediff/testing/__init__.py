"""Test, benchmark and sample helpers (they import torch and transformers; the core never imports this)."""
