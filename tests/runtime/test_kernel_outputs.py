"""A backend that returns its kernel library's own output (``returns_kernel_output``):
the forward hands that tensor back instead of copying it, checks what the hook returned,
and a ``GraphSession(kernel_outputs=True)`` keeps each bucket's captured outputs and
replays into them (cpu: the triton backend, under the interpreter, allocating its own
output the way FlashMLA does)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attnreg.registry import ForwardMode, get_registry  # noqa: E402
from attnreg.runtime import (  # noqa: E402
    GraphSession,
    MLAConfig,
    SessionError,
    decode_batch,
)

from ._session_inputs import random_inputs, random_pool  # noqa: E402

H = 2
DECODE4 = (ForwardMode.DECODE, 4)
DECODE2 = (ForwardMode.DECODE, 2)


@pytest.fixture(scope="module")
def cfg() -> MLAConfig:
    return MLAConfig(num_heads=H, page_size=16, max_context_len=256)


def _own_output_backend(cfg: MLAConfig, name: str = "triton", *,
                        shape_bug: bool = False) -> Any:
    """Backend ``name``, but allocating its output itself when given none (and remembering
    each tensor it made, to show the caller gets that one, not a copy)."""
    base = get_registry().create(name, cfg)

    class OwnOutput(type(base)):  # type: ignore[misc]
        returns_kernel_output = True
        made: list[torch.Tensor] = []

        def _forward_decode_impl(self, q, pool, md, out, **kw):  # type: ignore[no-untyped-def]
            if out is not None:
                return super()._forward_decode_impl(q, pool, md, out, **kw)
            mine = q.new_empty((q.shape[0], q.shape[1], self.config.kv_lora_rank),
                               dtype=torch.bfloat16)
            super()._forward_decode_impl(q, pool, md, mine, **kw)
            self.made.append(mine)
            return mine[1:] if shape_bug else mine

    return OwnOutput(cfg, capabilities=base.capabilities)






def test_a_forward_without_out_hands_back_the_kernels_own_tensor(cfg):
    be = _own_output_backend(cfg)
    pool = random_pool(cfg)
    batch = decode_batch(pool, [20, 7])
    q = torch.randn(2, H, 576).bfloat16()
    got = be.forward_decode(q, None, None, pool, batch)
    assert got is be.made[-1], "the hook's own tensor, not a copy of it"
    given = torch.full((2, H, 512), float("nan"), dtype=torch.bfloat16)
    assert be.forward_decode(q, None, None, pool, batch, out=given) is given
    assert torch.equal(given, got), "into out= the same numbers"


def test_a_hook_that_returns_the_wrong_rows_is_refused_not_passed_on(cfg):
    be = _own_output_backend(cfg, shape_bug=True)
    pool = random_pool(cfg)
    with pytest.raises(TypeError, match=r"decode hook .* output of shape \(2, 2, 512\)"):
        be.forward_decode(torch.randn(2, H, 576).bfloat16(), None, None, pool,
                          decode_batch(pool, [20, 7]))


def test_a_kernel_outputs_session_replays_into_each_buckets_own_outputs(cfg):
    be = _own_output_backend(cfg)
    oracle = get_registry().create("reference", cfg)
    pool = random_pool(cfg, layers=2)
    afters: list[list[torch.Tensor]] = []
    ses = GraphSession(be, pool, phase="decode", mode="full", buckets=[4, 2], layers=2,
                       writes_kv=False, kernel_outputs=True,
                       after_attention=lambda step: afters.append(step.outputs))
    assert ses.kernel_outputs
    ses.capture()
    four, two = ses.outputs(DECODE4), ses.outputs(DECODE2)
    assert [tuple(o.shape) for o in four + two] == [(4, H, 512)] * 2 + [(2, H, 512)] * 2
    assert all(any(o is m for m in be.made) for o in four + two), "the hook's tensors"
    assert len(afters[-1]) == 2 and all(a is b for a, b in zip(afters[-1], two)), \
        "after_attention sees the outputs the step returned"
    for o in ses.statics.outs:
        o.fill_(float("nan"))
    batch = decode_batch(pool, [30, 100, 7])
    inputs = random_inputs(3, H, layers=2, seed=1)
    res = ses.run(batch, inputs)
    assert res.replayed and res.bucket == 4
    now = ses.outputs(DECODE4)  # without device graphs a replay re-runs the step
    for i in range(2):
        assert res.outputs[i].data_ptr() == now[i].data_ptr(), "a view of the bucket's output"
        want = oracle.forward_decode(inputs.q[i], None, None, pool, batch, layer_id=i)
        assert torch.allclose(res.outputs[i].float(), want.float(), atol=2e-2)
        assert bool((now[i][3:] == 0).all()), "the padding row is zero"
        assert bool(ses.statics.outs[i].isnan().all()), "the static outputs are not written"
    small = ses.run(decode_batch(pool, [12]), random_inputs(1, H, layers=2, seed=2))
    assert small.bucket == 2 and small.output.data_ptr() == ses.outputs(DECODE2)[0].data_ptr()


def test_without_the_option_or_a_returning_backend_the_static_outputs_serve(cfg):
    pool = random_pool(cfg, layers=2)
    plain = GraphSession(_own_output_backend(cfg), pool, phase="decode", mode="full",
                         buckets=[4, 2], layers=2, writes_kv=False)
    registered = GraphSession(get_registry().create("triton", cfg), pool, phase="decode",
                             mode="full", buckets=[4, 2], layers=2, writes_kv=False,
                             kernel_outputs=True)
    for ses in (plain, registered):
        assert not ses.kernel_outputs
        ses.capture()
        outs = ses.outputs(DECODE2)
        assert [o.data_ptr() for o in outs] == [o.data_ptr() for o in ses.statics.outs]
        assert [o.shape[0] for o in outs] == [2, 2]


def test_a_step_of_its_own_must_return_the_outputs_it_is_handed_none_for(cfg):
    pool = random_pool(cfg, layers=2)
    ses = GraphSession(_own_output_backend(cfg), pool, phase="decode", mode="full",
                       buckets=[2], layers=2, writes_kv=False, kernel_outputs=True,
                       step=lambda step: None)
    with pytest.raises(SessionError, match="return every layer's output from the step"):
        ses.capture()
    with pytest.raises(SessionError, match="has no outputs yet"):
        ses.outputs(DECODE2)
