"""nn.Modules only: no I/O, no training code."""
