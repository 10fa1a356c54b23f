"""Which mode, template and instruction a request runs with (its own, the backend's defaults, or the model's), and
the request fields that those make meaningless, refused rather than ignored."""

from __future__ import annotations

from dataclasses import dataclass

from rerankit.engine.load import LoadedModel
from rerankit.errors import InvalidRequest
from rerankit.schema import ScoreRequest
from rerankit.templates import RAW, Template, detect_template, get_template


@dataclass(frozen=True)
class Defaults:
    """A backend's defaults for what a request leaves out: mode, template (a name or a ``Template``), instruction."""

    mode: str | None = None
    template: "str | Template | None" = None
    instruction: str | None = None


def resolve_request(request: ScoreRequest, loaded: LoadedModel,
                    defaults: Defaults) -> tuple[ScoreRequest, str, Template | None]:
    """The request with the defaults' instruction where its template takes one, its mode and its template."""
    mode = request.mode or defaults.mode or loaded.default_mode
    if mode not in loaded.supported_modes:
        raise InvalidRequest("mode", f"this model cannot score in mode {mode!r}; "
                             f"it supports {', '.join(loaded.supported_modes)}")
    template = resolve_template(request, loaded, defaults.template, mode)
    if defaults.instruction is not None and request.instruction is None and template is not None \
            and template.takes_instruction:  # (raw takes none)
        request = request.model_copy(update={"instruction": defaults.instruction})
    return request, mode, template


ENCODER_TAKES_NO_TEMPLATE = ("an encoder cross-encoder (BERT, RoBERTa, XLM-R) scores the pair as its tokenizer lays "
                             "it out ([CLS] query [SEP] document [SEP]) and reads [CLS]: it takes no template")


def resolve_template(request: ScoreRequest, loaded: LoadedModel, option: "str | Template | None",
                     mode: str) -> Template | None:
    """The request's template, else raw when it gives label ids, else the backend option, else the detected one.

    Bi-encoders and late interaction take no template: each text is encoded on its own.
    """
    if mode not in ("generative", "cross-encoder"):
        if request.template is not None:
            raise InvalidRequest("template", f"{mode} mode encodes the query and items alone; it takes no template")
        return None
    if not loaded.is_decoder:  # BERT, RoBERTa, XLM-R: read at [CLS] of the pair as the tokenizer lays it out
        if request.template is not None:
            raise InvalidRequest("template", ENCODER_TAKES_NO_TEMPLATE)
        return None
    if request.template is not None:
        return get_template(request.template)  # a name, or a Template given by its pieces
    if request.label_token_ids is not None:
        return get_template(RAW)  # vLLM /generative_scoring semantics
    if option is not None:
        return get_template(option)
    return detect_template(loaded.config, loaded.name)


def check_fields_apply(request: ScoreRequest, mode: str, template: Template | None) -> None:
    """Refuse fields that the chosen mode or template would silently ignore."""
    raw = template is not None and template.name == RAW
    if mode != "generative":
        for field in ("label_token_ids", "labels"):
            if getattr(request, field) is not None:
                raise InvalidRequest(field, f"labels are only read in generative mode, not {mode}")
        if request.return_label_logprobs:
            raise InvalidRequest("return_label_logprobs", f"there are no label log-probs in {mode} mode")
        if raw:
            raise InvalidRequest("template", f"the raw template is for generative scoring, not {mode}")
    if not raw:
        for field, default in (("item_first", False), ("add_special_tokens", True), ("mis_delimiter_token_id", None)):
            if getattr(request, field) != default:
                raise InvalidRequest(field, "only applies to raw scoring (label_token_ids without a template)")
    if request.instruction is not None and (template is None or raw):
        raise InvalidRequest("instruction", "this model's mode has no template that takes an instruction")
    if request.instruction is not None:
        check_instruction_written(template, request.instruction)
    if raw and request.item_first and request.mis_delimiter_token_id is not None:
        raise InvalidRequest("mis_delimiter_token_id", "cannot be combined with item_first")


def check_instruction_written(template: Template, instruction: str | None) -> None:
    """Refuse an ``instruction`` that ``template`` would not write (it holds no ``{instruction}``)."""
    if instruction is not None and not template.takes_instruction:
        raise InvalidRequest("instruction", f"template {template.name!r} has no {{instruction}} placeholder, so the "
                             "instruction would not be written: give a template that holds one")

