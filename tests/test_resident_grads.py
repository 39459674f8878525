"""Where stage 3's reduced gradients land when resident chunks hold GPU gradient buffers
([Note: resident gradients] in zeroio/shard/assist.py; ``GradLanding._route`` in
zeroio/partition/stage3/grads.py).

The landing is driven on the CPU with a router standing in for the step assist: every
element of each reduced slice must end in exactly one place (a chunk's buffer when the chunk
lies wholly inside the slice, else the host gradient shard), cast to 16 bits as the host
path casts, and a second write of a group must add where the first one went. The reference
is the same landing without a router."""

from __future__ import annotations

import torch

from zeroio.partition.stage3.grads import GradLanding, Landing
from zeroio.shard.types import ShardGroup


class _Chunk:
    def __init__(self, numel):
        self.g16 = torch.full((numel,), float("nan"), dtype=torch.bfloat16)
        self.host_grad = None
        self.grad_here = False


class _Router:
    """The assist's side of the protocol: chunks keyed (group, first element, elements)."""

    def __init__(self, chunks):
        self.chunks = {k: _Chunk(k[2]) for k in chunks}
        self.forgot = 0

    def grad_parts(self, group_index, lo, numel):
        return sorted(((k[1] - lo, c) for k, c in self.chunks.items()
                       if k[0] == group_index and lo <= k[1] and k[1] + k[2] <= lo + numel),
                      key=lambda x: x[0])

    def grads_written(self, event):
        raise AssertionError("no event on the CPU")

    def forget_grads(self):
        self.forgot += 1
        for c in self.chunks.values():
            c.grad_here = False


def _landing(router=None):
    # one optimizer group of 40 elements, fed by two parameter groups: group 0's shard
    # [0, 24) -> base 0, group 1's shard [4, 20) -> base 24
    sg = ShardGroup(group_index=0, master=torch.zeros(40),
                    grad=torch.full((40,), -7.0, dtype=torch.bfloat16), numel=40, segments=())
    pieces = {0: [Landing(lo=0, numel=24, target=0, base=0)],
              1: [Landing(lo=4, numel=16, target=0, base=24)]}
    landing = GradLanding([sg], pieces, torch.device("cpu"), pin=False)
    landing.router = router
    return landing, sg


def _whole(sg, router):
    """The gradient as the step reads it: the host shard, with each written chunk's buffer
    in its place."""
    out = sg.grad.clone()
    for (_, lo, n), c in router.chunks.items():
        if c.grad_here:
            out[lo:lo + n] = c.g16
    return out


def _backward(landing, twice):
    torch.manual_seed(0)
    a, b = torch.randn(24, dtype=torch.float64).float(), torch.randn(24).float() * 3
    landing.reset()
    landing.consume(0, a.clone(), 0.5, boundary=True)
    landing.consume(1, b.clone(), 0.5, boundary=True)
    if twice:  # group 1 reduced twice in one backward (reentrant checkpointing)
        landing.consume(1, b.clone() * 1e-3 + 1, 0.5, boundary=True)
    landing.settle(True, None)


def test_resident_slices_land_in_their_buffers_and_the_rest_on_the_host():
    # chunk (0, 8, 8) inside group 0's piece; (0, 24, 6) and (0, 34, 6) inside group 1's;
    # (0, 20, 8) straddles both pieces: not routed, its gradient stays on the host
    keys = [(0, 8, 8), (0, 24, 6), (0, 34, 6), (0, 20, 8)]
    for twice in (False, True):
        ref, ref_sg = _landing()
        _backward(ref, twice)
        router = _Router(keys)
        got, sg = _landing(router)
        _backward(got, twice)
        assert router.forgot == 1
        assert [router.chunks[k].grad_here for k in keys] == [True, True, True, False]
        assert torch.equal(_whole(sg, router), ref_sg.grad), twice  # same bits as the host
        # the routed slices did not touch the host shard (-7 marks unwritten elements)
        for k in keys[:3]:
            assert torch.all(sg.grad[k[1]:k[1] + k[2]] == -7.0), k
            c = router.chunks[k]
            assert c.host_grad.data_ptr() == sg.grad[k[1]:].data_ptr()
            assert c.host_grad.numel() == k[2]
        # every other element is on the host, as without the router
        mask = torch.ones(40, dtype=torch.bool)
        for k in keys[:3]:
            mask[k[1]:k[1] + k[2]] = False
        assert torch.equal(sg.grad[mask], ref_sg.grad[mask])
        # the norm is the fp32 one of the whole gradient either way
        assert torch.equal(got.sq_norm(), ref.sq_norm()) if not twice else (
            got.sq_norm() is None and ref.sq_norm() is None)


def test_a_second_write_adds_only_where_the_first_landed():
    # the chunk had no buffer role at the first write (its gradient went to the host), so
    # a second write of the same accumulation must add on the host too
    ref, ref_sg = _landing()
    router = _Router([(0, 26, 4)])
    got, sg = _landing(router)
    for landing in (ref, got):
        landing.reset()
    b = torch.linspace(-2, 2, 24)
    saved = router.chunks
    router.chunks = {}  # no resident chunk yet at the first write
    got.consume(1, b.clone(), 1.0, boundary=True)
    ref.consume(1, b.clone(), 1.0, boundary=True)
    router.chunks = saved
    got.consume(1, b.clone() + 0.25, 1.0, boundary=True)
    ref.consume(1, b.clone() + 0.25, 1.0, boundary=True)
    for landing in (ref, got):
        landing.settle(True, None)
    assert not saved[(0, 26, 4)].grad_here
    assert torch.equal(sg.grad, ref_sg.grad)
