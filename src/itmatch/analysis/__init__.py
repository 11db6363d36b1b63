"""Analyses over trained models: the perturbation study (OAN section 3)."""
