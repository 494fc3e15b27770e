"""The C++ side of a custom variant: its params struct and one inline function per snippet.

``variant.h`` (a rendered source of every module whose spec has a variant) holds

- ``struct VariantParams``, generated from ``abi.variant_params_entry`` (tensor: a pointer and
  its sizes; scalar: its value) by ``jitattn.abi`` -- the same list gives the
  ctypes mirror the launch fills;
- ``variant_<hook>(vp, value, index variables...)`` for each snippet of the
  variant. Each snippet is preceded by ``#line 1 "<hook>"``, so the compiler
  reports errors at ``<hook>:<line>``; ``explain_build_error`` turns that into
  the snippet's line and the compiler's message.

Templates call the functions inside ``{% if variant %}`` blocks only.
"""

from __future__ import annotations

import re
from typing import Any

from ..abi import VARIANT_FAULT_SYMBOL, Entry, c_type, variant_params_entry
from ..spec import Target, VariantSpec
from ..variant import HOOK_SIGNATURES, HOOKS, AttentionVariant

HEADER_NAME = "variant.h"
_QUALIFIER = {Target.CPU: "inline", Target.CUDA: "__device__ __forceinline__"}


def params_entry(variant: AttentionVariant) -> Entry:
    return variant_params_entry(variant)


FAULT_SYMBOL = VARIANT_FAULT_SYMBOL


def _debug_support(spec: VariantSpec) -> list[str]:
    """JITATTN_DEBUG=1: the fault record, the checked accessor and the host function that reads the record.

    An out-of-bounds read (or a read through an omitted optional tensor) records
    the first fault -- hook, parameter, index, size -- and yields 0 instead of
    touching memory; after each launch the loader calls ``jitattn_variant_debug_fault``
    and raises KernelError with that report. One translation unit includes this
    header, so the definitions below are not duplicated.
    """
    return _fault_record(spec) + CHECKED_ACCESSOR + _fault_reader(spec)


def _fault_record(spec: VariantSpec) -> list[str]:
    """The fault record and ``jitattn_report_fault``, which keeps the first fault (atomically)."""
    variant = spec.variant
    cuda = spec.target is Target.CUDA
    hooks = ", ".join(f'"{h}"' for h in HOOKS)
    params = ", ".join(f'"{p.name}"' for p in variant.params) or '""'
    space = "__device__ " if cuda else ""
    lines = [
        "// JITATTN_DEBUG=1: tensor parameters are bounds-checked accessors (jitattn.kernels.variant).",
        "#include <stdio.h>",
        "struct JitattnFault { int set; int hook; int param; long long index; long long size; };",
        f"static {space}JitattnFault jitattn_fault;",
        f"static const char* const jitattn_fault_hooks[] = {{{hooks}}};",
        f"static const char* const jitattn_fault_params[] = {{{params}}};",
        "JITATTN_VARIANT_FN void jitattn_report_fault(int hook, int param, long long index, long long size) {",
    ]
    if cuda:
        lines += [
            "  if (atomicCAS(&jitattn_fault.set, 0, 1) == 0) {",
            "    jitattn_fault.hook = hook; jitattn_fault.param = param;",
            "    jitattn_fault.index = index; jitattn_fault.size = size;",
            "    __threadfence();",
            "  }",
        ]
    else:
        lines += [
            "  int expected = 0;",
            "  if (__atomic_compare_exchange_n(&jitattn_fault.set, &expected, 1, false, __ATOMIC_ACQ_REL,",
            "                                  __ATOMIC_ACQUIRE)) {",
            "    jitattn_fault.hook = hook; jitattn_fault.param = param;",
            "    jitattn_fault.index = index; jitattn_fault.size = size;",
            "  }",
        ]
    return lines + ["}"]


# A snippet's value as its hook's type: any number (nonzero is true for logits_mask), but not a pointer (a tensor
# parameter named without its index: never null, so a mask of it hid nothing).
SNIPPET_VALUE = [
    "template <typename R, typename T>",
    "JITATTN_VARIANT_FN R jitattn_snippet_value(T x) {",
    '  static_assert(std::is_arithmetic<T>::value, "jitattn: the snippet is not a number (a tensor parameter needs '
    'its index: name[i])");',
    "  return static_cast<R>(x);",
    "}",
    "",
]

# The bounds-checked accessor a tensor parameter becomes under JITATTN_DEBUG=1.
CHECKED_ACCESSOR = [
    "template <typename T>",
    "struct JitattnChecked {",
    "  const T* ptr; int64_t size; int hook; int param;",
    "  template <typename I>",
    "  JITATTN_VARIANT_FN T operator[](I index) const {",
    '    static_assert(std::is_integral<I>::value, "jitattn: a tensor parameter\'s index must be an integer");',
    "    const int64_t i = static_cast<int64_t>(index);",
    "    if (ptr == nullptr || i < 0 || i >= size) { jitattn_report_fault(hook, param, i, size); return T(); }",
    "    return ptr[i];",
    "  }",
    "  JITATTN_VARIANT_FN T operator*() const { return (*this)[0]; }",
    "  JITATTN_VARIANT_FN explicit operator bool() const { return ptr != nullptr; }",
    "  JITATTN_VARIANT_FN bool operator==(decltype(nullptr)) const { return ptr == nullptr; }",
    "  JITATTN_VARIANT_FN bool operator!=(decltype(nullptr)) const { return ptr != nullptr; }",
    "};",
]


def _fault_reader(spec: VariantSpec) -> list[str]:
    """The exported host function that reads (and clears) the fault record and writes the error sentence."""
    variant = spec.variant
    cuda = spec.target is Target.CUDA
    lines = [
        f'extern "C" __attribute__((visibility("default"))) int {FAULT_SYMBOL}(char* err, int err_len) {{',
        "  JitattnFault fault;",
    ]
    if cuda:
        lines += [
            "  if (cudaMemcpyFromSymbol(&fault, jitattn_fault, sizeof(fault)) != cudaSuccess) return 0;",
            "  if (!fault.set) return 0;",
            "  const JitattnFault cleared = {0, 0, 0, 0, 0};",
            "  cudaMemcpyToSymbol(jitattn_fault, &cleared, sizeof(cleared));",
        ]
    else:
        lines += [
            "  fault = jitattn_fault;",
            "  if (!fault.set) return 0;",
            "  jitattn_fault = JitattnFault{0, 0, 0, 0, 0};",
        ]
    lines += [
        "  const char* param = jitattn_fault_params[fault.param];",
        "  if (fault.size == 0)",
        f'    snprintf(err, err_len, "variant {variant.name!r}: %s read %s[%lld], but %s is empty or was omitted "',
        '             "(an optional tensor not passed to run()); the output of this launch is not meaningful",',
        "             jitattn_fault_hooks[fault.hook], param, fault.index, param);",
        "  else",
        f'    snprintf(err, err_len, "variant {variant.name!r}: %s read %s[%lld] out of bounds (%s has %lld "',
        '             "elements, valid indices 0..%lld); the read returned 0 and the output of this launch is not "',
        '             "meaningful", jitattn_fault_hooks[fault.hook], param, fault.index, param, fault.size,',
        "             fault.size - 1);",
        "  return 1;",
        "}",
        "",
    ]
    return lines


def header(spec: VariantSpec, debug: bool = False) -> str:
    """The text of ``variant.h`` for ``spec`` (which has a variant).

    ``debug`` (JITATTN_DEBUG=1) binds each tensor parameter as a bounds-checked
    accessor instead of a raw pointer; without it the text is what it always was.
    """
    variant = spec.variant
    entry = params_entry(variant)
    lines = [
        f"// Generated by jitattn.kernels.variant for variant {variant.name!r} ({variant.token}); do not edit.",
        "#pragma once",
        "#include <stdint.h>",
        "#include <math.h>",
        "#include <type_traits>",
        "",
        f"struct {entry.struct_name} {{",
    ]
    lines += [f"  {c_type(f.kind)} {f.name};" for f in entry.fields]
    lines += ["};", "", f"#define JITATTN_VARIANT_FN {_QUALIFIER[spec.target]}", ""] + SNIPPET_VALUE
    if debug:
        lines += _debug_support(spec)

    def bindings(hook_id: int) -> list[str]:
        # Locals each function binds: typed tensor pointers (or checked accessors), sizes, scalars.
        out = []
        for param_id, param in enumerate(variant.params):
            if param.rank == 0:
                out.append(f"  [[maybe_unused]] const {param.c_type} {param.name} = vp.{param.name};")
            elif debug:
                size = " * ".join(f"vp.{param.name}_size{d}" for d in range(param.rank))
                out.append(f"  [[maybe_unused]] const JitattnChecked<{param.c_type}> {param.name}{{"
                           f"static_cast<const {param.c_type}*>(vp.{param.name}), {size}, {hook_id}, {param_id}}};")
            else:
                out.append(f"  [[maybe_unused]] const {param.c_type}* const {param.name} = "
                           f"static_cast<const {param.c_type}*>(vp.{param.name});")
            if param.rank:
                out += [f"  [[maybe_unused]] const int64_t {param.name}_size{d} = vp.{param.name}_size{d};"
                        for d in range(param.rank)]
        return out

    for hook_id, hook in enumerate(HOOKS):
        text = getattr(variant, hook)
        if text is None:
            continue
        ret, value, indices = HOOK_SIGNATURES[hook]
        args = [f"const {entry.struct_name}& vp", f"[[maybe_unused]] float {value}"]
        args += [f"[[maybe_unused]] int64_t {name}" for name in indices]
        lines.append(f"JITATTN_VARIANT_FN {ret} variant_{hook}({', '.join(args)}) {{")
        lines += bindings(hook_id)
        lines.append(f"  return jitattn_snippet_value<{ret}>((")  # (a comma expression stays one argument)
        lines.append(f'#line 1 "{hook}"')
        lines += text.splitlines()
        lines.append(f'#line {len(lines) + 2} "{HEADER_NAME}"')
        lines.append("  ));")
        lines.append("}")
        lines.append("")
    return "\n".join(lines) + "\n"


def _hook_lines(header_text: str):
    """(line number, text, hook) of each line of variant.h inside a snippet's function."""
    hook = None
    for number, line in enumerate(header_text.splitlines(), start=1):
        match = re.match(r"^JITATTN_VARIANT_FN \w+ variant_(\w+)\(", line)
        if match:
            hook = match.group(1)
        elif hook is not None:
            yield number, line, hook
            if line == "}":
                hook = None


def snippet_ends(header_text: str) -> dict[int, str]:
    """{line of variant.h: hook} for the lines that close a snippet's expression (``  ));`` and ``}``).

    A snippet that ends too early (``logits * (2.0f +``) makes the compiler
    report the closing line; this maps it back to the hook.
    """
    return {number: hook for number, line, hook in _hook_lines(header_text) if line in ("  ));", "}")}


def snippet_values(header_text: str) -> dict[int, str]:
    """{line of variant.h: hook} for the lines that return a snippet's value (``jitattn_snippet_value``): a snippet
    of the wrong type is reported where that template is instantiated from them."""
    return {number: hook for number, line, hook in _hook_lines(header_text)
            if line.startswith("  return jitattn_snippet_value<")}


_ASSERTION = re.compile(r'static assertion failed(?: with)?:?\s*"?jitattn: (?P<why>[^"\n]*)')
# where the failed assertion was instantiated: gcc/clang "variant.h:24:37:   required from here", nvcc "at line 24"
_INSTANTIATED = re.compile(re.escape(HEADER_NAME) + r":(?P<line>\d+)(?::\d+)?:\s*required from here"
                           r"|at line (?P<nline>\d+)")


def _value_error(variant: AttentionVariant, message: str, header_text: str) -> str | None:
    """A snippet whose value is not a number (``jitattn_snippet_value``'s assertion), as "hook: why" and its first
    line."""
    assertion = _ASSERTION.search(message)
    if assertion is None:
        return None
    where = _INSTANTIATED.search(message)
    hook = snippet_values(header_text).get(int(where["line"] or where["nline"])) if where else None
    if hook is None:
        return f"  a snippet: {assertion['why']}"
    return f"  {hook}: {assertion['why']}\n    | {(getattr(variant, hook) or '').splitlines()[0]}"


def context(spec: VariantSpec) -> dict[str, Any]:
    """The ``variant`` value templates receive: None, or what the variant's blocks need."""
    variant = spec.variant
    if variant is None:
        return {"variant": None}
    return {"variant": {
        "name": variant.name,
        "header": HEADER_NAME,
        "use_softmax": variant.use_softmax,
        "splittable": variant.splittable,
        **{hook: getattr(variant, hook) is not None for hook in HOOKS},
    }}


_LOCATION = re.compile(
    r"^(?P<hook>" + "|".join(HOOKS) + r")(?::(?P<line>\d+)(?::(?P<col>\d+))?|\((?P<nline>\d+)\))"
    r":?\s*(?P<message>.*)$"
)
# A diagnostic at the line that closes a snippet's expression (gcc/clang "variant.h:17:3: ...", nvcc
# "variant.h(17): ...").
_HEADER_LOCATION = re.compile(
    r"^(?:.*/)?" + re.escape(HEADER_NAME) + r"(?::(?P<line>\d+)(?::(?P<col>\d+))?|\((?P<nline>\d+)\))"
    r":?\s*(?P<message>.*)$"
)
DEBUG_HINT = ("a snippet that compiles but crashes the process (an index out of bounds) can be run with "
              "JITATTN_DEBUG=1: parameter reads are then bounds-checked and reported with the hook, the parameter "
              "and the index")
# What a failed JITATTN_DEBUG=1 build says instead: its tensor parameters are checked accessors, not pointers.
DEBUG_BUILD_HINT = ("this is a JITATTN_DEBUG=1 build, whose tensor parameters are bounds-checked accessors: they take "
                    "x[i], *x, x ? ... : ... and comparison with nullptr, not pointer arithmetic (write x[i] for "
                    "*(x + i)); the same snippet may compile without JITATTN_DEBUG")


def _clean(message: str) -> str:
    # gcc quotes with typographic quotes; keep the report plain ASCII.
    return message.strip().replace("\u2018", "'").replace("\u2019", "'")


def explain_build_error(spec: VariantSpec, message: str, header_text: str | None = None) -> str:
    """A compiler failure of ``spec``'s build, led by the snippet lines it points into.

    Each diagnostic inside a snippet (or at the end of one: an unfinished
    expression is reported where the snippet's expression is closed) becomes
    "hook, line N[, column C]: message" with the snippet's line and a caret.
    Returns ``message`` unchanged when no diagnostic names a snippet (the
    failure is then in jitattn's own code, and the full output is what helps).
    ``header_text``: the ``variant.h`` that was compiled (default: the non-debug one).
    """
    variant = spec.variant
    if variant is None:
        return message
    compiled = header_text or header(spec)
    ends = snippet_ends(compiled) if HEADER_NAME in message else {}
    value = _value_error(variant, message, compiled)
    found: list[str] = ([value] if value else []) + _name_collisions(variant, message, compiled)
    for raw in message.splitlines():
        text = raw.strip()
        match = _LOCATION.match(text)
        at_end = False
        if match:
            hook = match["hook"]
            line_no = int(match["line"] or match["nline"])
            col = int(match["col"]) if match["col"] else None
        else:
            match = _HEADER_LOCATION.match(text)
            if not match or int(match["line"] or match["nline"]) not in ends:
                continue
            hook = ends[int(match["line"] or match["nline"])]
            line_no = len((getattr(variant, hook) or "").splitlines()) or 1
            col, at_end = None, True
        if match["message"].strip().startswith("note"):
            continue  # notes repeat a location without news
        snippet_lines = (getattr(variant, hook) or "").splitlines()
        code = snippet_lines[line_no - 1] if 0 < line_no <= len(snippet_lines) else ""
        if at_end:
            col = len(code) + 1
        pointer = ""
        if col and code:
            pointer = "\n      " + " " * (col - 1) + "^"
        note = " (at the end of the snippet: the expression is unfinished)" if at_end else ""
        item = (f"  {hook}, line {line_no}: {_clean(match['message'])}{note}\n"
                f"    | {code}{pointer}")
        if item not in found:
            found.append(item)
    hint = DEBUG_BUILD_HINT if header_text is not None and "JitattnChecked" in header_text else DEBUG_HINT
    if not found:
        return message + "\n(" + hint + ")" if "compile failed" in message else message
    return (
        f"variant {variant.name!r} does not compile for target {spec.target.value!r}:\n" + "\n".join(found)
        + "\n(snippets are C++ expressions over the variables documented in jitattn.variant; " + hint + ")\n"
        + _source_note(message)
    )


def _name_collisions(variant: AttentionVariant, message: str, header_text: str) -> list[str]:
    """Parameters whose declaration in ``variant.h`` the compiler refused: a name the headers define as a macro
    (``M_1_PI``, ``EOF``, ``INT32_MAX``; the common ones are refused when the parameter is made)."""
    declared = {}
    for number, line in enumerate(header_text.splitlines(), start=1):
        for param in variant.params:
            # its field (``float name;``) or its local (``... name = vp.name;``), not a snippet's use of it
            if re.search(rf"\b{param.name}(?:;| = vp\.{param.name};)$", line):
                declared.setdefault(number, param.name)
    names = []
    for raw in message.splitlines():
        match = _HEADER_LOCATION.match(raw.strip())
        if match and int(match["line"] or match["nline"]) in declared:
            names.append(declared[int(match["line"] or match["nline"])])
    return [f"  parameter {name!r}: the C/C++ headers the kernel includes define this name (a macro), so it cannot "
            "name a parameter; rename it" for name in dict.fromkeys(names)]


def _source_note(message: str) -> str:
    """The BuildError's closing lines, which name the full log and the kept build directory."""
    notes = [line for line in message.strip().splitlines() if line.startswith(("(full log", "(rendered source"))]
    return "\n".join(notes)
