"""Requirements: declared once (BackendSpec.requires), third-party ones name their own
distribution, and every one of them decides availability."""

from __future__ import annotations

import pytest

from attnreg.registry import DeclarationContext, Platform, Requirement, load_registry
from attnreg.registry.spec import unmet_requirement

CPU = Platform.parse("cpu")


@pytest.mark.parametrize("req,hint", [
    (Requirement("acme_kernels", "acme-kernels", "1.2"), "pip install 'acme-kernels>=1.2'"),
    (Requirement("acme_kernels", "acme-kernels"), "pip install 'acme-kernels'"),
    (Requirement("flashinfer", "flashinfer-python", "0.6.13", extra="flashinfer"),
     "install attnreg[flashinfer]"),
    (Requirement("acme_kernels", "acme-kernels", install="conda install -c acme acme-kernels"),
     "conda install -c acme acme-kernels"),
])
def test_install_hint_names_the_distribution_unless_it_is_an_attnreg_extra(req, hint):
    assert req.install_hint() == hint


@pytest.mark.parametrize("args,meant", [
    (("torch", "torch", "torch", "2.4"), ("2.4", "torch")),
    (("acme", "acme", "flashinfer"), (None, "flashinfer")),
])
def test_the_old_positional_extra_warns_and_means_what_it_meant(args, meant):
    # attnreg 0.1.0: Requirement(import_name, distribution, extra, min_version=None)
    with pytest.warns(DeprecationWarning, match="uses attnreg 0.1.0's positional extra") as w:
        req = Requirement(*args)
    assert (req.min_version, req.extra) == meant
    assert req == Requirement(args[0], args[1], meant[0], extra=meant[1])
    assert w[0].filename == __file__  # points at the plugin's line, not at attnreg


def test_a_name_in_both_version_places_is_refused_with_the_signature():
    with pytest.raises(ValueError) as exc:
        Requirement("torch", "torch", "torch", "latest")
    assert str(exc.value) == (
        "Requirement('torch', 'torch', ...): min_version 'torch' is not a version such as "
        "'1.2'; the signature is Requirement(import_name, distribution, min_version=None, "
        "extra=None, install=None) (attnreg extras go in extra=)")


@pytest.mark.parametrize("versions,reason", [
    ({"acme-kernels": None}, "acme-kernels not installed: pip install 'acme-kernels>=1.2'"),
    ({"acme-kernels": "1.1.9"},
     "acme-kernels 1.1.9 is older than the 1.2 it needs: pip install 'acme-kernels>=1.2'"),
    ({"acme-kernels": "1.10"}, ""),
])
def test_unmet_requirement_says_why(versions, reason):
    req = Requirement("acme_kernels", "acme-kernels", "1.2")
    assert unmet_requirement(req, DeclarationContext(CPU, versions)) == reason


def test_a_third_party_requirement_makes_its_backend_unavailable(fake_site):
    reg = load_registry(allow=["thirdparty"])
    a = reg.availability("acme_mla", "cpu")
    assert not a.available
    assert a.reason == "acme-kernels not installed: pip install 'acme-kernels>=1.2'"
    # A simulated platform assumes optional libraries are installed.
    assert reg.availability("acme_mla", "cpu", assume_installed=True).available


def test_builtin_requirements_live_in_the_spec_only():
    reg = load_registry(autoload=False)
    for name in reg.names():
        assert reg.get(name).requires, name
        assert reg.declaration(name, "cuda:sm100").requires == (), name
    assert [r.distribution for r in reg.get("flashinfer_mla").requires] == \
        ["torch", "flashinfer-python"]
