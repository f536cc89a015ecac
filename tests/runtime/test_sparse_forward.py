"""Sparse (DSA) forwards: the reference against the float64 sparse oracle, and the
runtime's index check before any kernel."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.graph_policy import capturing  # noqa: E402
from attnreg.registry import (  # noqa: E402
    DType,
    ForwardMethod,
    GraphMode,
    Phase,
    UnsupportedError,
    get_registry,
)
from attnreg.runtime.refusals import sparse_index_problems  # noqa: E402
from attnreg.testing.claims import Combo  # noqa: E402
from attnreg.testing.sparse import (  # noqa: E402
    SPARSE_CASES,
    SparseCase,
    make_sparse_workload,
    oracle_sparse,
)
from attnreg.testing.workload import compare, compare_lse, make_config, make_pool  # noqa: E402


def setup(phase: Phase, case: SparseCase, seed: int = 1):  # type: ignore[no-untyped-def]
    combo = Combo(ForwardMethod.MLA, phase, DType.BF16, DType.BF16, 16, 2, (576, 512))
    config = make_config(combo, "cpu")
    backend = get_registry().create("reference", config, platform="cpu")
    pool = make_pool(config, [case.spec()])
    sw = make_sparse_workload(config, pool, case, seed=seed)
    backend.init_forward_metadata(sw.work.batch)
    return backend, pool, sw


def forward(backend, pool, sw, indices, **kw):  # type: ignore[no-untyped-def]
    w = sw.work
    return backend.forward_sparse(w.q, w.latent_new, w.rope_new, pool, w.batch,
                                  topk_indices=indices, **kw)


@pytest.mark.parametrize("phase, case", [(p, c) for p, cs in SPARSE_CASES.items() for c in cs],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_the_reference_matches_the_sparse_oracle(phase: Phase, case: SparseCase) -> None:
    backend, pool, sw = setup(phase, case)
    out, lse = forward(backend, pool, sw, sw.indices, return_lse=True)
    assert compare(out, sw.expected, DType.BF16, sw.spec) is None
    assert compare_lse(lse, sw.expected_lse, sw.spec) is None
    for r in case.empty_rows:   # a row of only -1 attends nothing
        assert bool((out[r] == 0).all()) and bool(torch.isneginf(lse[r]).all())


def test_the_oracle_counts_a_repeated_slot_twice_and_ignores_minus_one() -> None:
    q = torch.tensor([[[1.0, 0.0]]])
    rows = {0: torch.tensor([1.0, 10.0], dtype=torch.float64),
            1: torch.tensor([0.0, 20.0], dtype=torch.float64)}
    once, _ = oracle_sparse(q, rows, torch.tensor([[0, 1, -1]]), 2, 1.0)
    twice, _ = oracle_sparse(q, rows, torch.tensor([[0, 0, 1]]), 2, 1.0)
    e = torch.exp(torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(once[0, 0, 1], (e * 10 + 20) / (e + 1))
    assert torch.allclose(twice[0, 0, 1], (2 * e * 10 + 20) / (2 * e + 1))


@pytest.mark.parametrize("bad", [-2, "slots"])
def test_an_index_outside_the_pool_is_refused_before_the_kernel(bad: object) -> None:
    backend, pool, sw = setup(Phase.DECODE, SPARSE_CASES[Phase.DECODE][0])
    slots = pool.layer(0).num_slots
    value = slots if bad == "slots" else int(bad)  # type: ignore[call-overload]
    indices = sw.indices.clone()
    indices[1, 3] = value
    before = pool.layer(0).buffer.clone()
    with pytest.raises(UnsupportedError, match=rf"top-k index {value} at \(token 1, entry 3\)"):
        forward(backend, pool, sw, indices)
    assert torch.equal(pool.layer(0).buffer, before)   # nothing written, nothing launched


def test_index_dtype_shape_and_top_k_are_checked() -> None:
    backend, pool, sw = setup(Phase.DECODE, SPARSE_CASES[Phase.DECODE][0])
    with pytest.raises(UnsupportedError, match="must be torch.int32"):
        forward(backend, pool, sw, sw.indices.long())
    with pytest.raises(UnsupportedError, match=r"must be \[2 query tokens"):
        forward(backend, pool, sw, sw.indices[:1])
    wide = torch.full((2, 4096), -1, dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="top-k 4096 not in 1..2048"):
        forward(backend, pool, sw, wide)
    assert sparse_index_problems(sw.indices, 2, pool.layer(0).num_slots) == []


def test_a_sparse_mode_declared_unsupported_is_refused_under_capture() -> None:
    backend, pool, sw = setup(Phase.DECODE, SPARSE_CASES[Phase.DECODE][0])
    with capturing(GraphMode.FULL), pytest.raises(UnsupportedError,
                                                  match="sparse decode under full"):
        forward(backend, pool, sw, sw.indices)


def test_a_backend_without_sparse_kernels_refuses_indices() -> None:
    case = SPARSE_CASES[Phase.DECODE][0]
    combo = Combo(ForwardMethod.MLA, Phase.DECODE, DType.BF16, DType.BF16, 16, 2, (576, 512))
    config = make_config(combo, "cpu")
    reg = get_registry()
    caps = reg.declaration("reference", "cpu")
    from dataclasses import replace

    dense = replace(caps, sparse_kernels=(), sparse_graph_modes=())
    from attnreg.backends.reference import ReferenceBackend

    backend = ReferenceBackend(config, capabilities=dense)
    pool = make_pool(config, [case.spec()])
    sw = make_sparse_workload(config, pool, case, seed=3)
    backend.init_forward_metadata(sw.work.batch)
    with pytest.raises(UnsupportedError, match="declares no sparse MLA kernel for decode"):
        forward(backend, pool, sw, sw.indices)


def _sparse_capturable_reference():  # type: ignore[no-untyped-def]
    """The reference with its sparse prefill declared NATIVE under BREAKABLE (its dense
    prefill stays UNSUPPORTED there): a phase only sparse kernels can capture."""
    from dataclasses import replace

    from attnreg.backends.reference import ReferenceBackend
    from attnreg.registry import CaptureSupport, GraphModeSupport

    caps = get_registry().declaration("reference", "cpu")
    modes = tuple(GraphModeSupport(e.phase, e.mode, CaptureSupport.native("test"))
                  if (e.phase, e.mode) == (Phase.PREFILL, GraphMode.BREAKABLE) else e
                  for e in caps.sparse_graph_modes)
    sparse_caps = replace(caps, sparse_graph_modes=modes)
    assert sparse_caps.graph_support(Phase.PREFILL, GraphMode.BREAKABLE).capture.is_unsupported
    combo = Combo(ForwardMethod.MLA, Phase.PREFILL, DType.BF16, DType.BF16, 16, 2, (576, 512))
    config = make_config(combo, "cpu")
    return ReferenceBackend(config, capabilities=sparse_caps), config


def test_a_sparse_capture_reads_the_sparse_graph_modes() -> None:
    backend, config = _sparse_capturable_reference()
    modes = {Phase.PREFILL: GraphMode.BREAKABLE}
    with pytest.raises(UnsupportedError, match="prefill under breakable graph capture"):
        backend.init_cuda_graph_state(4, 32, graph_modes=modes)       # the dense declaration
    backend.init_cuda_graph_state(4, 32, graph_modes=modes, sparse=True)
    assert backend.graph_state is not None and backend.graph_state.sparse
    backend.init_forward_metadata_capture(2, 16, forward_mode="extend")   # bound, sparse
    dense = _sparse_capturable_reference()[0]
    with pytest.raises(UnsupportedError, match="sparse path is declared eagerly only"):
        dense.init_cuda_graph_state(4, 32, graph_modes={Phase.DECODE: GraphMode.FULL},
                                    sparse=True)                # sparse decode FULL: not declared


def test_a_sparse_only_prefill_is_captured_and_replayed_through_the_session() -> None:
    from attnreg.runtime import GraphSession, StepInputs

    backend, config = _sparse_capturable_reference()
    case = SPARSE_CASES[Phase.PREFILL][0]
    pool = make_pool(config, [case.spec()], spare_pages=4)
    sw = make_sparse_workload(config, pool, case, seed=11)
    rows = sw.work.batch.num_tokens
    static_idx = torch.full((rows + 2, sw.indices.shape[1]), -1, dtype=torch.int32)
    static_idx[:rows] = sw.indices

    def step(s):  # type: ignore[no-untyped-def]
        n = s.inputs.q[0].shape[0]
        backend.forward_sparse(s.inputs.q[0], s.inputs.latent_new[0], s.inputs.rope_new[0],
                               pool, s.batch, out=s.outputs[0], topk_indices=static_idx[:n])

    with pytest.raises(UnsupportedError, match="prefill under breakable"):
        GraphSession(backend, pool, phase="prefill", mode="breakable", buckets=[rows + 2],
                     step=step, device_graphs=False, warmup=0)     # dense: not capturable
    session = GraphSession(backend, pool, phase="prefill", mode="breakable",
                           buckets=[rows + 2], step=step, device_graphs=False, warmup=0,
                           max_requests=sw.work.batch.batch_size + 1,
                           max_seq_len=sw.work.batch.max_seq_len, sparse=True)
    inputs = StepInputs.one(sw.work.q, sw.work.latent_new, sw.work.rope_new)
    session.capture(batches={rows + 2: sw.work.batch}, inputs={rows + 2: inputs})
    outs = session.replay(sw.work.batch, inputs, bucket=rows + 2)
    assert compare(outs[0], sw.expected, DType.BF16, sw.spec) is None
