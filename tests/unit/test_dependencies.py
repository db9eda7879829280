"""What squishlike takes from other packages matches what pyproject.toml declares.

Every third-party package the runtime imports is declared. Where squishlike uses another package's private
internals, pyproject.toml caps that package at the minor series tested, and these tests fail loudly, naming the
package and the symbol, when an upgrade removes or reshapes one of those internals.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]

# (distribution, module, attribute path, the parameters squishlike calls or overrides it with)
PRIVATE_APIS = [
    ("mlx-lm", "mlx_lm.utils", "_get_classes", ["config"]),
    ("mlx-lm", "mlx_lm.utils", "_download", ["path_or_hf_repo", "revision", "allow_patterns"]),
    (
        "transformers",
        "transformers.integrations.gguf.gguf_tokenizer_mapping",
        "convert_gguf_tokenizer",
        ["architecture", "tokenizer_dict"],
    ),
    ("transformers", "transformers.integrations.gguf.gguf_tokenizer_mapping", "GGUF_TOKENIZER_MAPPING", None),
    ("transformers", "transformers.models.auto.tokenization_auto", "tokenizer_class_from_name", ["class_name"]),
]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_requirements() -> dict[str, Requirement]:
    """pyproject.toml's requirements (runtime and every extra) by normalized distribution name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    requirements = {}
    for line in lines:
        requirement = Requirement(line)
        # mlx appears once per platform; keep the one for this machine
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            requirements.setdefault(normalized(requirement.name), requirement)
    return requirements


def imported_top_level_modules() -> set[str]:
    """Top-level names of every absolute import in the squishlike package's source."""
    names = set()
    for path in (ROOT / "squishlike").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_every_imported_package_is_declared():
    # benchmarks/: the source checkout's own harness, which `squishlike bench` runs where it is present; the
    # extension module this project builds (maturin's module-name)
    extension = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["maturin"]["module-name"]
    first_party = {"squishlike", "benchmarks", "__future__", extension}
    third_party = imported_top_level_modules() - set(sys.stdlib_module_names) - first_party
    distributions = importlib.metadata.packages_distributions()
    declared = declared_requirements()
    # an optional package that is not installed here is looked up by its module name
    undeclared = sorted(
        module for module in third_party if not any(normalized(d) in declared for d in distributions.get(module, [module]))
    )
    assert not undeclared, f"squishlike imports packages that pyproject.toml does not declare: {undeclared}"


def test_every_requirement_has_a_lower_bound():
    requirements = declared_requirements().values()
    unbounded = [str(r) for r in requirements if not any(s.operator in (">=", "==", "~=") for s in r.specifier)]
    assert not unbounded, f"pyproject.toml requirements without a lower bound: {unbounded}"


@pytest.mark.parametrize("distribution", sorted({api[0] for api in PRIVATE_APIS}))
def test_private_api_users_are_capped_at_the_tested_version(distribution):
    requirement = declared_requirements()[distribution]
    assert any(s.operator in ("<", "<=") for s in requirement.specifier), (
        f"pyproject.toml's {requirement} has no upper bound, but squishlike uses {distribution}'s private internals"
    )
    version = importlib.metadata.version(distribution)
    assert requirement.specifier.contains(version), (
        f"{distribution} {version} is installed, outside pyproject.toml's {requirement}: test it, then move the bound"
    )


@pytest.mark.parametrize(("distribution", "module", "attribute", "parameters"), PRIVATE_APIS, ids=lambda v: str(v))
def test_private_api_is_still_there(distribution, module, attribute, parameters):
    where = f"{distribution} {importlib.metadata.version(distribution)}"
    target = importlib.import_module(module)
    for part in attribute.split("."):
        if not hasattr(target, part):
            pytest.fail(f"{where} no longer has the private {module}.{attribute}, which squishlike uses")
        target = getattr(target, part)
    if parameters is not None:
        found = list(inspect.signature(target).parameters)
        assert found == parameters, (
            f"{where} changed the private {module}.{attribute}: parameters {found}, squishlike expects {parameters}"
        )


def test_gguf_tokenizer_mapping_has_the_groups_squishlike_reads():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    where = f"transformers {importlib.metadata.version('transformers')}"
    missing = {"tokenizer", "tokenizer_config"} - GGUF_TOKENIZER_MAPPING.keys()
    assert not missing, f"{where}: GGUF_TOKENIZER_MAPPING lost the groups {sorted(missing)} that squishlike reads"


def test_mlx_lm_tools_still_call_the_loader_squishlike_rebinds():
    import mlx_lm
    import mlx_lm.utils

    from squishlike.mlx_lm_tools import TESTED_MLX_LM, TOOLS

    assert mlx_lm.__version__.startswith(f"{TESTED_MLX_LM}."), (
        f"mlx_lm {mlx_lm.__version__} is installed; squishlike's seam into its tools is tested on {TESTED_MLX_LM}.x"
    )
    for tool in TOOLS:
        module = importlib.import_module(f"mlx_lm.{tool}")
        assert module.load is mlx_lm.utils.load, f"mlx_lm.{tool} no longer calls mlx_lm.utils.load as `load`"
