"""The adapter's Megatron-Core version gate: the tested range passes, anything else is refused by name."""
from __future__ import annotations

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.megatron import version as mv


@pytest.mark.parametrize("v", ["0.16.0", "0.16.1", "0.17.0rc0", "0.18.2", "0.19.2+630898f", "0.20.0+d98e8a6"])
def test_tested_releases_and_main_pass(v, monkeypatch):
    monkeypatch.delenv(mv.ENV_ANY, raising=False)
    assert mv.check_megatron_version(v) == v


@pytest.mark.parametrize("v", ["0.15.3", "0.21.0", "1.0.0", "dev"])
def test_other_versions_are_refused_naming_version_range_and_fix(v, monkeypatch):
    monkeypatch.delenv(mv.ENV_ANY, raising=False)
    with pytest.raises(ConfigError) as e:
        mv.check_megatron_version(v)
    text = str(e.value)
    assert f"megatron-core {v} is outside" in text and ">=0.16,<0.20" in text and mv.ENV_ANY in text


def test_the_escape_hatch_accepts_any_version(monkeypatch):
    monkeypatch.setenv(mv.ENV_ANY, "1")
    assert mv.check_megatron_version("0.14.0") == "0.14.0"


def test_the_installed_megatron_is_in_range(monkeypatch):
    pytest.importorskip("megatron.core")
    monkeypatch.delenv(mv.ENV_ANY, raising=False)
    assert mv.parse(mv.check_megatron_version()) >= (0, 16)


def test_the_drop_in_refuses_an_untested_megatron_before_touching_it(monkeypatch):
    pytest.importorskip("megatron.core")
    from het_plugin.megatron import mcore as core
    monkeypatch.delenv(mv.ENV_ANY, raising=False)
    monkeypatch.setattr(mv, "installed_version", lambda: "0.99.0")
    with pytest.raises(ConfigError, match="megatron-core 0.99.0 is outside"):
        core.initialize_model_parallel(1, 1)


# ---- one statement of the supported versions (issue 31): each place that states it says the same ----------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_pyprojects_megatron_extra_requires_the_gates_releases():
    import re
    text = (ROOT / "pyproject.toml").read_text()
    (line,) = [ln for ln in text.splitlines() if re.match(r"\s*megatron\s*=\s*\[", ln)]
    assert f'"{mv.extra_requirement()}"' in line
    lo, hi = re.search(r"megatron-core>=([\d.]+),<([\d.]+)", line).groups()
    assert mv.parse(lo) == mv.TESTED[0] and mv.parse(hi) == (mv.TESTED[1][0], mv.TESTED[1][1] + 1)


@pytest.mark.parametrize("doc", ["README.md", "docs/megatron.md"])
def test_readme_and_docs_state_the_gates_range_word_for_word(doc):
    text = " ".join((ROOT / doc).read_text().split())
    assert mv.supported_range() in text


@pytest.mark.parametrize("v,accepted", [("0.19.9", True), ("0.20.0", True), ("0.20.0rc0", True),
                                        ("0.20.1", False), ("0.20.10", False), ("0.21.0", False)])
def test_only_mains_version_is_accepted_beyond_the_releases(v, accepted, monkeypatch):
    monkeypatch.delenv(mv.ENV_ANY, raising=False)
    if accepted:
        assert mv.check_megatron_version(v) == v
    else:
        with pytest.raises(ConfigError, match="Megatron-LM main reporting 0.20.0"):
            mv.check_megatron_version(v)
