"""Every name docs/architecture.md gives in backticks exists, so a rename fails here until the page
follows it.

Outside fenced blocks, an inline span is checked when it is (a call's arguments are dropped first,
`f(x)` is `f`):
- a path in the repository: path characters with a "/" in them (a trailing "/" is a folder, a "*"
  a glob that must match), not starting with "/" (a URL's path);
- `python -m MODULE ...`: the module can be found;
- `torch.ops.dspark.NAME`: the op is registered once the ops are imported;
- a dotted name: a class of dspark's (`Class.attribute`, inherited or set on `self` in a method),
  a module of dspark's by its last part (`openai.TextStream`), or an importable module and the
  attributes under it (`dspark.decoder.capture_step`, `torch.compile`); a file name
  (`checkpoint.pt`) is not a dotted name;
- a bare identifier with an underscore or a capital (`ancestral_draft`, `TargetModel`,
  `RECOMPILE_LIMIT`): defined in dspark/ or bench/ (at the top of a module, in a class, or on
  `self`). Plain lowercase words (`generate`) are not checked, nor spans with other characters.
"""
import ast
import dataclasses
import functools
import glob
import importlib
import importlib.util
import re
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
FILE_SUFFIXES = {"py", "md", "pt", "json", "jsonl", "gguf", "safetensors", "sh", "toml", "txt", "bin", "cfg"}
IDENTIFIER = r"[A-Za-z_]\w*"
DOTTED = re.compile(rf"{IDENTIFIER}(\.{IDENTIFIER})+")


@dataclasses.dataclass
class CodeIndex:
    classes: dict[str, list[str]]  # class name -> the modules that define one
    modules: dict[str, str]  # a module's last part -> the module
    names: set[str]  # names defined at a module's top, in a class's body, or on self


def defined_names(statements: list[ast.stmt]) -> set[str]:
    names = set()
    for node in statements:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


@functools.cache
def code_index() -> CodeIndex:
    classes, modules, names = {}, {}, set()
    for path in sorted([*ROOT.glob("dspark/**/*.py"), *ROOT.glob("bench/*.py")]):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules.setdefault(module.rsplit(".", 1)[-1], module)
        tree = ast.parse(path.read_text())
        names |= defined_names(tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(module)
                names |= defined_names(node.body)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return CodeIndex(classes, modules, names)


def self_attributes(cls: type) -> set[str]:
    """Names a class's methods (its bases' too) assign on self, and its annotated fields."""
    names = set()
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
        try:
            tree = ast.parse(importlib.import_module(klass.__module__).__loader__.get_source(klass.__module__))
        except (AttributeError, ImportError, TypeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
                names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                          and isinstance(n.value, ast.Name) and n.value.id == "self" and isinstance(n.ctx, ast.Store)}
    return names


def has_attribute(obj, name: str) -> bool:
    return hasattr(obj, name) or (isinstance(obj, type) and name in self_attributes(obj))


def find_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent that is a module, not a package
        return False


def resolves(obj, attributes: list[str]) -> bool:
    for part in attributes:
        if not has_attribute(obj, part):
            return False
        obj = getattr(obj, part, None)
    return True


def resolve_dotted(name: str) -> bool:
    first, *rest = name.split(".")
    index = code_index()
    if first in index.classes:  # any of dspark's classes of that name
        return any(resolves(getattr(importlib.import_module(module), first), rest) for module in index.classes[first])
    if first in index.modules:
        return resolves(importlib.import_module(index.modules[first]), rest)
    parts = name.split(".")
    end = next((end for end in range(len(parts), 0, -1) if find_module(".".join(parts[:end]))), None)
    return end is not None and resolves(importlib.import_module(".".join(parts[:end])), parts[end:])


def import_ops() -> None:
    for path in ROOT.glob("dspark/ops/*.py"):
        importlib.import_module(f"dspark.ops.{path.stem}")


def missing(span: str) -> bool:
    """Whether a checked span names nothing that exists (see the module's docstring)."""
    span = span.strip()
    if span.startswith("python -m "):
        module = span.split()[2]
        return re.fullmatch(rf"{IDENTIFIER}(\.{IDENTIFIER})*", module) is not None and not find_module(module)
    span = re.sub(r"\(.*\)$", "", span)
    if "/" in span and not span.startswith("/") and re.fullmatch(r"[\w.*/-]+", span):
        if "*" in span:
            return not glob.glob(str(ROOT / span))
        path = ROOT / span
        return not (path.is_dir() if span.endswith("/") else path.exists())
    if span.startswith("torch.ops.dspark.") and re.fullmatch(rf"torch\.ops\.dspark\.{IDENTIFIER}", span):
        import_ops()
        return not hasattr(torch.ops.dspark, span.rsplit(".", 1)[1])
    if DOTTED.fullmatch(span):
        if span.rsplit(".", 1)[1] in FILE_SUFFIXES:
            return False
        return not resolve_dotted(span)
    if re.fullmatch(IDENTIFIER, span) and re.search(r"[_A-Z]", span):
        return span not in code_index().names
    return False


def inline_spans(markdown: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose)


def missing_names(markdown: str) -> list[str]:
    return [span for span in inline_spans(markdown) if missing(span)]


def test_every_name_in_the_architecture_page_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert len(inline_spans(text)) > 100
    assert missing_names(text) == []


def test_the_check_finds_renamed_names():
    """The control: names that do not exist, each of a kind the page uses, are found; their
    existing neighbours are not."""
    text = textwrap.dedent("""
    `dspark/decoder.py` `dspark/no_such.py` `tests/interpret/` `dspark/decoder.py/` `dspark/*.py` `docs/*.nope`
    `python -m dspark.serve --port 1` `python -m dspark.no_such`
    `torch.ops.dspark.verify` `torch.ops.dspark.no_such`
    `SpeculativeDecoder.prefill` `SpeculativeDecoder.no_such` `StepRunner.graphs` `StepRunner.no_such`
    `SamplingTensors.all_greedy` `dspark.decoder.capture_step` `dspark.decoder.no_such`
    `openai.TextStream` `openai.no_such` `torch.compile(fullgraph=True)` `torch.no_such`
    `ancestral_draft` `ancestral_drafts` `RECOMPILE_LIMIT` `NoSuchClass` `checkpoint.pt` `generate`
    ```
    `dspark/in_a_fenced_block.py`
    ```
    """)
    assert missing_names(text) == [
        "dspark/no_such.py", "dspark/decoder.py/", "docs/*.nope", "python -m dspark.no_such",
        "torch.ops.dspark.no_such", "SpeculativeDecoder.no_such", "StepRunner.no_such", "dspark.decoder.no_such",
        "openai.no_such", "torch.no_such", "ancestral_drafts", "NoSuchClass"]


@pytest.mark.parametrize("span", ["x = (base_k + bias) / T", "emitted[num_accepted]", "--out", "/v1/models",
                                  "DESIGN.md", "python -m bench.<name>", "<name>_torch"])
def test_spans_that_are_not_names_are_not_checked(span):
    assert not missing(span)
