"""Structured outputs (vLLM's ``StructuredOutputsParams``): which grammar a request's output must follow, normalised
and checked when built; :mod:`iterserve.engine.structured_output` compiles it against the model's vocabulary.
:mod:`iterserve.sampling_params` re-exports both names, where vLLM's users import them from.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from iterserve.errors import SamplingParamsError

# A grammar's text (a JSON schema, a regex, a Lark grammar, the choices together): compiling grows
# faster than its size (docs/structured_output.md gives the times).
MAX_GRAMMAR_CHARS = 256 * 1024

# Compact JSON ("," and ":" separators, no whitespace): a model cannot pad the output with
# whitespace until max_tokens runs out, and the text is what json.dumps would write.
JSON_OPTIONS: Any = {"whitespace_flexible": False}  # a JsonCompileOptions TypedDict


_CHECK_GRAMMARS: ContextVar[bool] = ContextVar("check_grammars", default=True)


@contextmanager
def grammar_checks_deferred() -> Iterator[None]:
    """Build StructuredOutputsParams without checking their grammars (only their shape and size), for
    callers that check them elsewhere: the server, on its grammar pool with a time limit, before it
    admits a request; the engine core, which decodes requests the server has checked and compiles them
    on its own pool (a grammar can take seconds to check; neither an event loop nor a step loop may wait)."""
    token = _CHECK_GRAMMARS.set(False)
    try:
        yield
    finally:
        _CHECK_GRAMMARS.reset(token)


def close_objects(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that has ``properties``
    and does not say: a model is then held to the keys the schema names. Left open, a grammar lets
    it add keys (even one twice) until max_tokens runs out, which is what a client sending a schema
    without the flag rarely wants; vLLM's default backend compiles schemas the same way. Members of
    an ``allOf`` stay open, since each must accept the others' keys."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            out[key] = {k: close_objects(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "not", "if", "then",
                     "else", "contains"):
            out[key] = close_objects(value)
        elif key == "allOf" and isinstance(value, list):
            out[key] = [close_objects(s, in_all_of=True) for s in value]
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out and not in_all_of:
        out["additionalProperties"] = False
    return out


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names): exactly one of ``json`` (a JSON schema, as a
    dict or a string), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings)
    or ``grammar`` (a Lark or a GBNF grammar, as llama.cpp and vLLM's examples write them).

    A schema's objects allow only the properties they name unless they say otherwise
    (``disable_additional_properties``, vLLM's option, defaults to true here: see
    :func:`close_objects`); set it false to compile schemas as written.

    The spec is normalised to a string and checked when built, so a bad schema or regex is refused
    before the request is queued (:class:`SamplingParamsError` naming the field); the engine core
    compiles it against the model's vocabulary.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_additional_properties: bool = True

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs", "structured_outputs needs exactly one of json, "
                                      f"json_object, regex, choice or grammar; got {given or 'none'}")
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise SamplingParamsError(name, f"{name} must be a string, got {type(value).__name__}")
        if self.choice is not None:
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingParamsError("choice", "choice must be a non-empty list of non-empty strings")
        kind = self.kind
        text = getattr(self, kind)
        size = sum(len(c) + 3 for c in self.choice) if self.choice is not None else len(text) if isinstance(
            text, str) else 0
        if size > MAX_GRAMMAR_CHARS:
            raise SamplingParamsError(kind, f"the {kind} has {size} characters; at most {MAX_GRAMMAR_CHARS} are "
                                            "allowed")
        if _CHECK_GRAMMARS.get():
            self._check_grammar()

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    def ll_grammar(self) -> str:
        """This constraint as an llguidance grammar; raises ValueError when its JSON does not parse.

        No vocabulary is needed: the engine core compiles the grammar against the model's
        (:class:`iterserve.engine.structured_output.GrammarCompiler`).
        """
        import llguidance  # the grammar engine loads only when a constraint is made

        kind = self.kind
        if kind == "json":
            assert isinstance(self.json, str)  # normalised when built
            schema = json.dumps(close_objects(json.loads(self.json))) if self.disable_additional_properties \
                else self.json
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            assert self.regex is not None
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            assert self.choice is not None
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.grammar_from("grammar", self.grammar or "")  # Lark or GBNF, told apart by llguidance

    def _check_grammar(self) -> None:
        """Raise SamplingParamsError (naming the field) when this constraint does not compile to a grammar."""
        import llguidance

        kind = self.kind
        try:
            grammar = self.ll_grammar()
        except ValueError as e:
            raise SamplingParamsError(kind, f"invalid {kind}: {e}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise SamplingParamsError(kind, f"invalid {kind}: {messages[0]}")
