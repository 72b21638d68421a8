"""Private ``torch.autograd.Function`` classes, one file per hazard family."""
