"""The eager host path kept cheap without changing what it computes: flashinfer's page
indices built by device ops, the error wrapper of kernel launches, the cache of accepted
requests and the per-batch split-KV workspace of the Triton backend
(benchmarks/host_overhead.py measures the cost; docs/benchmarks-host-overhead.md)."""

from __future__ import annotations

import pytest
import torch

from attnreg.registry import UnsupportedError, get_registry, load_registry
from attnreg.runtime import KernelErrors, MLAConfig, decode_batch


def _kernels(monkeypatch, page_size: int):
    from backends_lib.fakes import install_fake_flashinfer

    from attnreg.backends.flashinfer_mla import FlashInferMLAKernels

    install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=page_size)
    return FlashInferMLAKernels("flashinfer_mla", cfg, torch.device("cpu"))


def _per_row(table: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """The plain definition: the first pages[b] entries of row b, concatenated."""
    return torch.cat([table[b, :n] for b, n in enumerate(pages)]).to(torch.int32)


@pytest.mark.parametrize("pages", [[3, 3, 3], [3, 1, 0, 2], [0, 0], [5], [1, 4]],
                         ids=["full", "ragged", "empty", "one", "two"])
@pytest.mark.parametrize("layout", ["contiguous", "column_slice"])
def test_page_indices_match_the_per_row_definition(monkeypatch, pages: list[int],
                                                   layout: str) -> None:
    kernels = _kernels(monkeypatch, page_size=1)
    width = max(max(pages), 1)
    gen = torch.Generator().manual_seed(len(pages))
    wide = torch.randint(1, 1000, (len(pages), width + 2), generator=gen, dtype=torch.int32)
    table = wide[:, :width] if layout == "column_slice" else wide[:, :width].contiguous()
    got = kernels._page_indices(table, pages)
    assert got.dtype == torch.int32 and got.device == table.device
    assert torch.equal(got, _per_row(table, pages))


def test_page_indices_of_a_whole_table_are_the_table_itself(monkeypatch) -> None:
    kernels = _kernels(monkeypatch, page_size=1)
    table = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    got = kernels._page_indices(table, [4, 4, 4])
    assert got.data_ptr() == table.data_ptr(), "a full table needs no gather and no copy"
    assert torch.equal(got, table.reshape(-1))


def test_page_indices_refuse_a_row_longer_than_the_table(monkeypatch) -> None:
    kernels = _kernels(monkeypatch, page_size=1)
    with pytest.raises(UnsupportedError, match="page table has 2 columns"):
        kernels._page_indices(torch.zeros(2, 2, dtype=torch.int32), [1, 3])


@pytest.mark.parametrize("page_size", [1, 16])
def test_plan_inputs_match_the_per_row_definition(monkeypatch, page_size: int) -> None:
    kernels = _kernels(monkeypatch, page_size=page_size)
    seq, ext = [40, 1, 0, 17], [1, 1, 0, 3]
    pages = [-(-s // page_size) for s in seq]
    table = torch.randint(1, 500, (len(seq), max(pages) + 1), dtype=torch.int32)
    got = kernels.plan_inputs(seq, ext, table)
    assert got.qo_indptr.tolist() == [0, 1, 2, 2, 5]
    assert got.kv_indptr.tolist() == [0, *torch.tensor(pages).cumsum(0).tolist()]
    assert got.kv_lens.tolist() == seq
    assert torch.equal(got.kv_indices, _per_row(table, pages))
    padded = kernels.plan_inputs(seq, ext, table, pad_to=(6, 9))
    assert padded.kv_lens.tolist() == [*seq, 0, 0, 9 - sum(ext)]
    filler_pages = -(-(9 - sum(ext)) // page_size)
    assert padded.kv_indices.tolist() == _per_row(table, pages).tolist() + [0] * filler_pages


def test_decode_plan_inputs_pad_with_one_row_requests_of_no_key(monkeypatch) -> None:
    """A decode shape's padding: one request per padding sequence, one query row each, no
    key and no page -- ``bs`` requests (the grid's average stays the heads), no filler."""
    kernels = _kernels(monkeypatch, page_size=16)
    seq, ext = [40, 1, 17], [1, 1, 1]
    table = torch.randint(1, 500, (3, 3), dtype=torch.int32)
    got = kernels.plan_inputs(seq, ext, table, pad_to=(5, 5), one_row_padding=True)
    assert got.qo_indptr.tolist() == [0, 1, 2, 3, 4, 5]
    assert got.kv_lens.tolist() == [*seq, 0, 0]
    assert got.kv_indptr.tolist() == [0, 3, 4, 6, 6, 6]
    assert torch.equal(got.kv_indices, _per_row(table, [3, 1, 2]))
    with pytest.raises(UnsupportedError, match="do not fit"):
        kernels.plan_inputs(seq, [1, 2, 1], table, pad_to=(5, 5), one_row_padding=True)


def _pages_of(inputs, page_size: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Each request's pages as flashinfer's MLA kernels read them: from kv_indptr[i], as many
    as kv_len[i] tokens fill (scheduler.cuh MLAPlan, mla_hopper.cuh)."""
    idx = inputs.kv_indices.tolist()
    return [idx[start:start + -(-n // page_size)]
            for start, n in zip(inputs.kv_indptr.tolist(), inputs.kv_lens.tolist())]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("seq", "ext", "bs", "nt"), [
    ([40, 1, 17], [1, 1, 1], 4, 4),       # decode, one padded sequence
    ([40, 9, 17, 30], [1, 1, 1, 1], 4, 4),  # decode, the bucket full
    ([40, 9], [3, 3], 4, 12),             # verify: the filler in the padding rows
    ([20, 9, 17, 30], [2, 1, 3, 1], 4, 12),  # draft extend, full: the compacted form
    ([], [], 2, 2),                       # nothing real
])
def test_graph_plan_inputs_read_the_table_in_place_and_name_the_same_pages(
        monkeypatch, page_size: int, seq: list[int], ext: list[int], bs: int, nt: int) -> None:
    kernels = _kernels(monkeypatch, page_size=page_size)
    width = -(-64 // page_size)
    gen = torch.Generator().manual_seed(bs + nt + len(seq))
    table = torch.zeros(6, width, dtype=torch.int32)  # a graph buffer: max_bs 6, padding 0
    table[:len(seq)] = torch.randint(1, 500, (len(seq), width), generator=gen,
                                     dtype=torch.int32)
    view = table[:bs]  # md.page_table: the captured shape's rows
    # decode shapes pad with one-row requests of no key (bs requests), the others with a
    # filler (bs + 1)
    one_row = bs == nt
    got = kernels.graph_plan_inputs(seq, ext, view, bs, nt, one_row_padding=one_row)
    want = kernels.plan_inputs(seq, ext, view, pad_to=(bs, nt), one_row_padding=one_row)
    assert got.qo_indptr.tolist() == want.qo_indptr.tolist()
    assert got.kv_lens.tolist() == want.kv_lens.tolist()
    assert len(got.kv_indptr) == len(want.kv_indptr) == bs + (1 if one_row else 2)
    assert _pages_of(got, page_size) == _pages_of(want, page_size)
    in_place = one_row or len(seq) < bs or sum(ext) == nt
    assert (got.kv_indices.data_ptr() == table.data_ptr()) is in_place, \
        "the table is read where it is, unless the filler has no padding row to use"


def test_kernel_errors_convert_library_value_errors_only() -> None:
    with pytest.raises(UnsupportedError, match="bad shape") as info:
        with KernelErrors("demo", "decode inputs", "fix the inputs"):
            raise ValueError("bad shape")
    assert isinstance(info.value.__cause__, ValueError)
    original = UnsupportedError("demo", "something", "declared unsupported")
    with pytest.raises(UnsupportedError) as passed:
        with KernelErrors("demo", "decode inputs", "fix the inputs"):
            raise original
    assert passed.value is original
    with pytest.raises(TypeError):
        with KernelErrors("demo", "decode inputs", "fix the inputs"):
            raise TypeError("not a refusal")
    with KernelErrors("demo", "decode inputs", "fix the inputs"):
        pass


def _triton(cfg: MLAConfig, **options: object):
    return get_registry().create("triton", cfg, platform="cpu", **options)


def test_accepted_requests_are_checked_once_and_refusals_every_time(monkeypatch) -> None:
    cfg = MLAConfig(num_heads=2, page_size=1)
    tri = _triton(cfg)
    pool = cfg.make_pool(64)
    batch = decode_batch(pool, [5, 9])
    asked = []
    caps_cls = type(tri.capabilities)
    check = caps_cls.check_request

    def counting(self, *args, **kwargs):
        asked.append(args)
        return check(self, *args, **kwargs)

    monkeypatch.setattr(caps_cls, "check_request", counting)  # frozen: patch the class
    q = torch.randn(2, 2, 576).to(torch.bfloat16)
    tri.forward_decode(q, None, None, pool, batch)
    tri.forward_decode(q, None, None, pool, batch)
    assert len(asked) == 1, "an accepted request is looked up, not re-checked"
    for bad in (q.to(torch.float64), q[0]):
        with pytest.raises(UnsupportedError, match="query"):
            tri.forward_decode(bad, None, None, pool, batch)


def test_triton_eager_workspace_is_planned_once_per_batch() -> None:
    cfg = MLAConfig(num_heads=2, page_size=1)
    tri = _triton(cfg, force_kv_splits=3)
    ref = load_registry(autoload=False).create("reference", cfg, platform="cpu")
    pool = cfg.make_pool(128)
    pool.buffer.normal_(generator=torch.Generator().manual_seed(0))
    batch = decode_batch(pool, [40, 70])
    q = torch.randn(2, 2, 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tri.init_forward_metadata(batch)
    md = tri.forward_metadata
    assert md is not None
    workspace = md.plan.workspace
    assert workspace is not None and tuple(workspace.partial_out.shape) == (2, 3, 2, 512)
    first = tri.forward_decode(q, None, None, pool, batch)
    second = tri.forward_decode(q, None, None, pool, batch)
    assert tri.forward_metadata is md and md.plan.workspace is workspace
    assert torch.equal(first, second)
    want = ref.forward_decode(q, None, None, pool, batch)
    assert (first.float() - want.float()).abs().max().item() <= 2e-2


def test_triton_one_split_needs_no_workspace() -> None:
    cfg = MLAConfig(num_heads=2, page_size=1)
    tri = _triton(cfg, force_kv_splits=1)
    pool = cfg.make_pool(16)
    tri.init_forward_metadata(decode_batch(pool, [3]))
    assert tri.forward_metadata is not None
    assert tri.forward_metadata.plan.workspace is None


def test_page_indices_of_full_rows_ignore_table_rows_beyond_the_batch():
    """A graph's page table has max_bs rows; only the batch's rows are its indices."""
    from types import SimpleNamespace

    import torch

    from attnreg.backends.flashinfer_mla import FlashInferMLAKernels

    kernels = SimpleNamespace(owner="flashinfer_mla")
    table = torch.arange(12, dtype=torch.int32).view(4, 3)  # 4 slots, 3 pages each
    got = FlashInferMLAKernels._page_indices(kernels, table, [3, 3])  # type: ignore[arg-type]
    assert got.tolist() == [0, 1, 2, 3, 4, 5]
    got = FlashInferMLAKernels._page_indices(kernels, table, [1, 3])  # type: ignore[arg-type]
    assert got.tolist() == [0, 3, 4, 5]
