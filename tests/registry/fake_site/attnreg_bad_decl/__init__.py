import attnreg
from attnreg import Capabilities, DType, ForwardMethod, KernelConstraints, Phase, Vendor


def capabilities(ctx):
    # Nonsense on purpose: absorbed MLA with MHA head dims, and no graph modes declared.
    return Capabilities(
        backend="bad_decl_mla", platform=ctx.platform, vendors=frozenset({Vendor.CUDA}),
        kernels=(KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), ((192, 128),),
                                   frozenset({DType.BF16}), frozenset({DType.BF16}),
                                   page_sizes=(3,)),),
        graph_modes=(),
    )


@attnreg.hookimpl
def attnreg_register_backends(register):
    register(attnreg.BackendSpec(name="bad_decl_mla", summary="declares nonsense",
                                 capabilities=capabilities, runtime="nowhere:Nothing"))
