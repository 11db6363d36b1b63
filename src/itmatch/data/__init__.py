"""Everything before a tensor reaches a model."""
