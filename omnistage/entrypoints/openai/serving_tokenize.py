"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's request and response shapes.

``/tokenize`` takes either ``{"prompt": str, "add_special_tokens": true}`` (the
tokens a text completion would see) or ``{"messages": [...],
"add_generation_prompt": true}`` (the chat template rendered as a chat
completion renders it; ``add_special_tokens`` defaults to false there since the
template holds any BOS). It answers ``{"count", "max_model_len", "tokens"}``,
plus ``token_strs`` when ``return_token_strs`` is true. ``/detokenize`` takes
``{"tokens": [int, ...]}`` and answers ``{"prompt": str}``; every id must lie
in the model's vocabulary. Chat content must be text: media parts are refused
(their placeholder expansion belongs to the processor, not the tokenizer).

The tokenizer runs in the engine thread, like every other engine call.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.protocol import ChatMessage, parse_request
from omnistage.entrypoints.openai.serving_common import ServingContext, prepare_on_engine, template_kwargs


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeCompletionRequest(_Strict):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Strict):
    model: StrictStr | None = None
    messages: list[ChatMessage]
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


def parse_tokenize_request(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The chat form when the body has ``messages``, else the prompt form."""
    chat = isinstance(body, dict) and "messages" in body
    return parse_request(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)


def _text_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        content = msg.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    param = f"messages[{i}].content[{j}]"
                    raise bad_request(
                        f"{param}: /tokenize takes text content only, got a {part.get('type')!r} part", param=param
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role, "content": content or ""}
        if msg.name:
            entry["name"] = msg.name
        out.append(entry)
    return out


class TokenizeServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.ctx.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            messages = _text_messages(req.messages)
            kwargs = template_kwargs(self.ctx, req.chat_template_kwargs, req.add_generation_prompt)

            def render(engine: Any) -> str:
                # The same rendering as a chat completion's (encode_chat), so the counts agree.
                return engine.encode_chat(messages, **kwargs)["prompt"]

            try:
                text = await prepare_on_engine(self.ctx, render)
            except APIError:
                raise
            except Exception as exc:  # noqa: BLE001 - template errors (role order, bad kwargs) are the client's
                raise bad_request(f"Could not apply the chat template: {exc}", param="messages", code="invalid_messages") from None
        else:
            text = req.prompt

        def encode(engine: Any) -> tuple[list[int], list[str] | None]:
            ids = engine.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
            strs = engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return list(ids), strs

        tokens, token_strs = await prepare_on_engine(self.ctx, encode)
        return TokenizeResponse(count=len(tokens), max_model_len=self.ctx.max_model_len, tokens=tokens, token_strs=token_strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.ctx.check_model(req.model)
        engine = self.ctx.client.engine
        vocab_size = getattr(engine, "vocab_size", None) or len(engine.tokenizer)
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab_size:
                raise bad_request(
                    f"Token id {t} at tokens[{i}] is outside the vocabulary [0, {vocab_size})",
                    param=f"tokens[{i}]",
                    code="invalid_token_id",
                )
        tokens = list(req.tokens)
        text = await prepare_on_engine(self.ctx, lambda engine: engine.tokenizer.decode(tokens))
        return DetokenizeResponse(prompt=text)
