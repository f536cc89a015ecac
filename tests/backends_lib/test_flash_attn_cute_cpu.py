"""FlashAttnCuteBackend on a CPU machine, with flash-attn-4 faked (fakes.py).

On sm90 FA4 asserts inside ``_validate_head_dims`` for the absorbed (64, 512)
shapes; the backend must refuse with an UnsupportedError before FA4 is ever
called -- from the sm90 declaration, and from its own device check when it was
built with an sm100 declaration on a non-Blackwell device."""

from __future__ import annotations

import pytest

from attnreg.graph_policy.capture import capturing
from attnreg.registry import ForwardMethod, GraphMode, UnsupportedError, load_registry
from attnreg.runtime import MLAConfig

from ._cases import assert_close, expected, make_case, make_pool
from .fakes import install_fake_flash_attn_cute


@pytest.fixture(scope="module")
def reg():
    return load_registry(autoload=False)


def backend(reg, cfg: MLAConfig, platform: str, *, sm: int | None = None):
    from attnreg.backends.flash_attn_cute import FlashAttnCuteBackend

    b = FlashAttnCuteBackend(cfg, capabilities=reg.declaration("flash_attn_cute", platform))
    if sm is not None:
        b.device_sm = sm  # what device_sm() reports on that GPU
    return b


def test_sm90_refuses_absorbed_extend_before_fa4_is_called(reg, monkeypatch) -> None:
    calls = install_fake_flash_attn_cute(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=16)
    fa = backend(reg, cfg, "cuda:sm90", sm=90)
    pool = make_pool(cfg, 100)
    case = make_case(cfg, pool, [5], [7])
    with pytest.raises(UnsupportedError, match="Blackwell"):
        fa.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch,
                          method=ForwardMethod.MLA)
    assert calls == []


@pytest.mark.parametrize("sm", [90, None], ids=["sm90", "cpu"])
def test_device_check_refuses_absorbed_extend_off_blackwell(reg, monkeypatch,
                                                            sm: int | None) -> None:
    """Built with the sm100 declaration (a simulated platform) on another device."""
    calls = install_fake_flash_attn_cute(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=16)
    fa = backend(reg, cfg, "cuda:sm100", sm=sm)
    pool = make_pool(cfg, 100)
    case = make_case(cfg, pool, [5], [7])
    with pytest.raises(UnsupportedError, match=f"Blackwell-only.*this is {'sm90' if sm else 'cpu'}"):
        fa.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch,
                          method=ForwardMethod.MLA)
    assert calls == []


@pytest.mark.parametrize("nope", [128, 64], ids=["192_128", "128_128"])
def test_mha_varlen_with_prefix_matches_reference(reg, monkeypatch, nope: int) -> None:
    calls = install_fake_flash_attn_cute(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=16, qk_nope_head_dim=nope)
    assert cfg.mha_head_dims == (nope + 64, 128)
    fa = backend(reg, cfg, "cuda:sm90", sm=90)
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [0, 33], [9, 4], mha=True, seed=2)
    got = fa.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch,
                            method=ForwardMethod.MHA, k=case.k, v=case.v)
    assert_close(got, expected(cfg, case, ForwardMethod.MHA), what="fa4 mha")
    assert calls[-1]["qv"] is False and calls[-1]["causal"] is True


@pytest.mark.parametrize("mode", [None, GraphMode.BREAKABLE], ids=["eager", "breakable"])
@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_absorbed_qv_path_on_blackwell_uses_one_split(reg, monkeypatch, mode,
                                                      page_size: int) -> None:
    calls = install_fake_flash_attn_cute(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=page_size)
    fa = backend(reg, cfg, "cuda:sm100", sm=100)
    pool = make_pool(cfg, 400)
    case = make_case(cfg, pool, [0, 130], [12, 5], seed=3)
    if mode is None:
        got = fa.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch)
    else:
        fa.init_cuda_graph_state(2, 32, max_seq_len=256, graph_modes={"prefill": mode})
        fa.init_forward_metadata_capture(2, 17, case.batch)
        with capturing(mode):
            got = fa.forward_extend(case.q, case.latent_new, case.rope_new, pool)
    assert_close(got, expected(cfg, case), what="fa4 qv")
    assert calls[-1]["qv"] is True and calls[-1]["num_splits"] == 1
    assert calls[-1]["dims"] == (64, 512)


def test_decode_is_not_served(reg, monkeypatch) -> None:
    calls = install_fake_flash_attn_cute(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=16)
    fa = backend(reg, cfg, "cuda:sm100", sm=100)
    pool = make_pool(cfg, 100)
    case = make_case(cfg, pool, [5], [1], decode=True)
    with pytest.raises(UnsupportedError, match="decode"):
        fa.forward_decode(case.q, case.latent_new, case.rope_new, pool, case.batch)
    assert calls == []
