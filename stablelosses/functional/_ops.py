"""The stable ops (stub: being written)."""


def safe_sqrt(input):
    raise NotImplementedError


def safe_div(input, other, *, fill=0.0):
    raise NotImplementedError


def logsumexp(input, dim, keepdim=False):
    raise NotImplementedError


def softmax(input, dim, *, mask=None):
    raise NotImplementedError


def log_softmax(input, dim, *, mask=None):
    raise NotImplementedError


def xlogy(input, other):
    raise NotImplementedError
