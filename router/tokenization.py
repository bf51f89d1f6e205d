"""POST /tokenize and POST /detokenize, as vLLM has them: the server's own tokens, and back.

    POST /tokenize    {"prompt": str, "add_special_tokens"?: true, "return_token_strs"?: false}
                      or {"messages": [...], "add_generation_prompt"?: true,
                          "add_special_tokens"?: false, "return_token_strs"?: false}
                      -> {"count", "max_model_len", "tokens": [...], "token_strs": [...] | null}
    POST /detokenize  {"tokens": [...]} -> {"prompt": str}

The messages form renders the chat template as /v1/chat/completions does, so a client counts
exactly the tokens its chat request will use. No group is involved, so these routes take no
admission ticket; the API key, the body bounds and the model check are the other routes'. A
text longer than the context can hold is refused as a prompt is (400) before it is tokenized:
the tokenizing pool is the generation routes' too.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tandem.router.engine_client import EngineClient
from tandem.router.protocol import MAX_MESSAGES, ChatMessage, TokenId, _Strict


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's own (BOS ...), as a completion's prompt gets them
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes its own: these would come on top
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_request_model(body: dict) -> type[TokenizeCompletionRequest | TokenizeChatRequest]:
    """Which form a /tokenize body is (vLLM's union): messages make it a chat."""
    return TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest


class TokenizationServing:
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """The prompt's (or the rendered chat's) tokens; ValueError names a text too long to fit."""
        text = self.client.text
        if isinstance(req, TokenizeChatRequest):
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]  # as ChatServing renders them
            tokens = await text.render_chat(messages, "messages", add_generation_prompt=req.add_generation_prompt,
                                            add_special_tokens=req.add_special_tokens)
        else:
            tokens = await text.tokenize(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        token_strs = await text.token_strings(tokens) if req.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.client.max_model_len, tokens=tokens,
                                token_strs=token_strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """The tokens' text as the tokenizer decodes them (special tokens kept); ValueError for
        an id outside the model's vocabulary."""
        vocab_size = self.client.vocab_size
        outside = next((t for t in req.tokens if t >= vocab_size), None)
        if outside is not None:
            raise ValueError(f"tokens: token id {outside} is not in this model's vocabulary (its ids are below "
                             f"{vocab_size})")
        return DetokenizeResponse(prompt=await self.client.text.decode(req.tokens))
