"""Private ``torch.autograd.Function`` classes, one file per hazard family; ``rows.py`` is the
row core that the softmax family and the classification losses share."""
