"""The image's Python requirements, per variant, from pyproject.toml (run by the Dockerfile).

``requirements.py VARIANT [--torch]`` prints the project's runtime dependencies with the ONNX
Runtime of the variant: ``cpu`` keeps ``onnxruntime``; ``cuda`` replaces it with
``onnxruntime-gpu[cuda,cudnn]`` (the CUDA and cuDNN libraries as wheels, so the image needs only
the host's driver). The two packages install the same ``onnxruntime`` module and must never be
installed together, so the project itself is then installed with ``pip install --no-deps``.
``--torch`` adds the ``torch`` extra (pinned there).

``requirements.py --check VARIANT`` exits 1, naming the packages, unless exactly the variant's
ONNX Runtime is installed in the running interpreter's environment.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import pathlib
import re
import sys
import tomllib

RUNTIMES = {"cpu": "onnxruntime", "cuda": "onnxruntime-gpu"}
EXTRAS = {"cpu": "", "cuda": "[cuda,cudnn]"}
PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def requirements(variant: str, torch: bool, pyproject: pathlib.Path = PYPROJECT) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    deps = list(project["dependencies"])
    if torch:
        deps += project["optional-dependencies"]["torch"]
    out = []
    for dep in deps:
        if _name(dep) == "onnxruntime":
            version = dep[len("onnxruntime"):]
            dep = f"{RUNTIMES[variant]}{EXTRAS[variant]}{version}"
        out.append(dep)
    return out


def installed_runtimes() -> set[str]:
    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    return names & set(RUNTIMES.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=sorted(RUNTIMES))
    parser.add_argument("--torch", action="store_true", help="add the torch extra")
    parser.add_argument("--check", action="store_true", help="check the installed ONNX Runtime instead")
    args = parser.parse_args(argv)
    if args.check:
        found = installed_runtimes()
        if found != {RUNTIMES[args.variant]}:
            print(f"variant {args.variant} needs exactly {RUNTIMES[args.variant]!r}; installed: {sorted(found)}",
                  file=sys.stderr)
            return 1
        return 0
    print("\n".join(requirements(args.variant, args.torch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
