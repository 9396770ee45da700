"""``backend="triton"``: fused Triton kernels (not landed yet)."""


def _missing(*args, **kwargs):
    raise NotImplementedError("backend='triton' is not implemented yet; use backend='torch'")


select = attention = kl = _missing
