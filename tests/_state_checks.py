"""Code the worker scripts of the DeepSpeed and HF Trainer tests share, as text: they run
under torchrun in processes of their own, so each script's text pastes it in.

:data:`STATE_CHECKS` needs ``io``, ``torch``, ``torch.distributed as dist`` and
``xxhash`` imported above it, and defines what a rank reports of the state it resumed:

- ``tensors(value, out)``: every tensor in a nested state, in a fixed order;
- ``saves_back(state)``: a user's own ``torch.save`` of ``state`` loads back bit for bit
  (issue 36);
- ``gathered_digests(mine)``: every rank's digest of its tensors ``mine`` (every rank
  calls it);
- ``full_digest(module)``: the digest of ZeRO's consolidated state, each parameter's full
  fp32 value and Adam moments, equal whatever the partitioning (every rank calls it).
"""

from __future__ import annotations

__all__ = ["STATE_CHECKS"]

STATE_CHECKS = r"""
def tensors(value, out):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            tensors(value[k], out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            tensors(v, out)

def saves_back(state):
    buf = io.BytesIO(); torch.save(state, buf); buf.seek(0)
    old, new = [], []; tensors(state, old); tensors(torch.load(buf, weights_only=False), new)
    # Bit for bit: a NaN (uninitialized padding of a flat buffer) equals itself here.
    bits = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)
    return len(old) == len(new) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
        for x, y in zip(old, new))

def gathered_digests(mine):
    h = xxhash.xxh3_64()
    for t in mine:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, h.hexdigest())
    return out

def full_digest(module):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    h = xxhash.xxh3_64()
    for _, p in module.named_parameters():
        for t in (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"),
                  safe_get_full_optimizer_state(p, "exp_avg_sq")):
            h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()
"""
