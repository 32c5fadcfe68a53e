"""The request fields that ask for structured output: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` and older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
At most one may be given; each becomes a ``GrammarSpec`` naming the field it came from."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from linnet.serve.engine import RequestError
from linnet.serve.grammar import GrammarCompiler, GrammarConstraint, GrammarSpec
from linnet.serve.tools import ToolPlan

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class _Fields(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Fields):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Fields):
    """vLLM's ``structured_outputs``: one of its fields."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The structured-output fields of a request (mixed into the request bodies)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _tool_plan: ToolPlan | None = PrivateAttr(None)
    _constraints: list[GrammarConstraint] = PrivateAttr(default_factory=list)

    def prepare_output(self, compiler: GrammarCompiler, choices: int, plan: ToolPlan | None = None) -> None:
        """Compile what the output must follow, a matcher for each of the ``choices`` (on the worker thread that
        reads the body: a new grammar takes milliseconds, the tokenizer's first one about a second), and keep
        the tool plan whose calls the output is read for. A grammar and a forced tool call at once are refused."""
        spec = self.grammar_spec()
        tool_spec = plan.grammar(compiler.literal) if plan is not None else None
        if spec is not None and tool_spec is not None:
            raise RequestError(f"{spec.field} and tool_choice both constrain the output; send one",
                               spec.field.split(".")[0])
        spec = spec or tool_spec
        self._tool_plan = plan if plan is not None and plan.parses else None
        self._constraints = [compiler.constraint(spec) for _ in range(choices)] if spec is not None else []

    def constraint(self, choice: int) -> GrammarConstraint | None:
        """Choice ``choice``'s own matcher (``prepare_output``), or None."""
        return self._constraints[choice] if self._constraints else None

    @property
    def output_tools(self) -> ToolPlan | None:
        """The tool plan whose calls the output is read for (None: the output is all content)."""
        return self._tool_plan

    def grammar_spec(self) -> GrammarSpec | None:
        """The grammar the request asks for, or None; two at once are refused, naming both."""
        asked = [spec for spec in (self._response_format(), *self._structured_outputs(), *self._guided()) if spec]
        if len(asked) > 1:
            fields = " and ".join(s.field for s in asked)
            raise RequestError(f"{fields} both ask for structured output; send one", asked[0].field.split(".")[0])
        if asked and asked[0].kind == "choice" and not asked[0].source:
            raise RequestError(f"{asked[0].field} needs at least one choice", asked[0].field.split(".")[0])
        return asked[0] if asked else None

    def _response_format(self) -> GrammarSpec | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return GrammarSpec("json_schema", ANY_JSON_OBJECT, "response_format")
        if rf.json_schema is None:
            raise RequestError("response_format.json_schema is required when its type is json_schema",
                               "response_format")
        return GrammarSpec("json_schema", rf.json_schema.schema_ or ANY_JSON_OBJECT,
                           "response_format.json_schema.schema", strict=bool(rf.json_schema.strict))

    def _structured_outputs(self) -> list[GrammarSpec]:
        so = self.structured_outputs
        if so is None:
            return []
        field = "structured_outputs."
        return [spec for spec in (
            so.json_ is not None and GrammarSpec("json_schema", so.json_, field + "json"),
            so.regex is not None and GrammarSpec("regex", so.regex, field + "regex"),
            so.choice is not None and GrammarSpec("choice", so.choice, field + "choice"),
            so.grammar is not None and GrammarSpec("grammar", so.grammar, field + "grammar"),
            bool(so.json_object) and GrammarSpec("json_schema", ANY_JSON_OBJECT, field + "json_object"),
        ) if spec]

    def _guided(self) -> list[GrammarSpec]:
        return [spec for spec in (
            self.guided_json is not None and GrammarSpec("json_schema", self.guided_json, "guided_json"),
            self.guided_regex is not None and GrammarSpec("regex", self.guided_regex, "guided_regex"),
            self.guided_choice is not None and GrammarSpec("choice", self.guided_choice, "guided_choice"),
            self.guided_grammar is not None and GrammarSpec("grammar", self.guided_grammar, "guided_grammar"),
        ) if spec]
