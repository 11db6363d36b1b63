"""Training and evaluation."""
