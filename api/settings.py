"""API settings: one BaseSettings class (environment variables ``GAGGLE_*``), injected with ``Depends``."""

from __future__ import annotations

from fastapi import Request
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.gc_policy import YOUNG_THRESHOLD


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GAGGLE_", extra="ignore")

    redis_url: str = "redis://localhost:6379/0"
    model_name: str = "rwkv-7"
    # other names a request's `model` may give for it (comma-separated); "*": any name. Others: 404.
    model_aliases: str = "rwkv-7"
    max_model_len: int = Field(1 << 20, ge=2)  # prompt + max_tokens, as the workers' engines enforce
    max_prompt_tokens: int = Field(32768, ge=1)
    max_queue: int = Field(10_000, ge=0)  # XLEN of every request stream (queued + in flight)
    max_queue_per_tenant: int = Field(0, ge=0)  # the same for one tenant's streams; 0: only max_queue applies
    max_n: int = Field(16, ge=1)
    max_sequences_per_call: int = Field(256, ge=1)  # prompts × n of one call
    max_body_bytes: int = Field(4 << 20, ge=1024)  # a request body above this is a 413
    default_chat_max_tokens: int = Field(1024, ge=1)  # chat without max_tokens / max_completion_tokens
    request_timeout_s: float = Field(600.0, gt=0)  # sync requests: then cancelled and answered 504
    response_ttl_s: int = Field(7 * 24 * 3600, ge=1)  # stored responses (Responses API store) expire after this
    keepalive_s: float = Field(15.0, gt=0)  # SSE comment line while nothing else is sent
    result_poll_s: float = Field(3.0, gt=0)  # fallback poll of result keys against a missed final message
    worker_cache_s: float = Field(1.0, ge=0)  # how long "is a worker alive" answers are reused
    retry_after_s: int = Field(2, ge=1)  # Retry-After on 429 / 503
    api_keys_file: str | None = None  # lines "key tenant"
    api_keys: str = ""  # GAGGLE_API_KEYS="key1:tenantA,key2:tenantB"
    # RWKV chat format; "{content}" is replaced by the message text
    chat_system_template: str = "System: {content}\n\n"
    chat_user_template: str = "User: {content}\n\n"
    chat_assistant_template: str = "Assistant: {content}\n\n"
    chat_tool_template: str = "Tool: {content}\n\n"  # a tool's result (role "tool")
    chat_generation_prompt: str = "Assistant:"
    chat_default_stop: list[str] = ["\n\nUser:"]
    # Batch API
    files_dir: str = ".gaggle/files"  # the file store, shared by the API and the batch workers
    batch_window: int = Field(4096, ge=1)  # a batch's lines in flight at a time
    batch_completion_window_s: int | None = Field(None, ge=1)  # tests: shorter than the "24h" clients ask for
    gc_young_threshold: int = Field(YOUNG_THRESHOLD, ge=1)  # engine/gc_policy.py (GAGGLE_GC_YOUNG_THRESHOLD)
    log_level: str | None = None  # set: configure logging in each API process (uvicorn --workers spawns)
    log_format: str = "json"
    instance_id: str = ""  # set by ``gaggle up`` so that it knows its own API from another on the port


    def serves(self, model: str | None) -> bool:
        """A request naming ``model`` is for this service's model (no model: the served one, as vLLM)."""
        aliases = {a.strip() for a in self.model_aliases.split(",") if a.strip()}
        return model is None or model == self.model_name or model in aliases or "*" in aliases

    def model_ids(self) -> list[str]:
        """The served name, then its aliases ("*" is not a name)."""
        aliases = [a.strip() for a in self.model_aliases.split(",") if a.strip() not in ("", "*")]
        return [self.model_name, *(a for a in dict.fromkeys(aliases) if a != self.model_name)]


async def get_settings(request: Request) -> Settings:
    """The app's settings (a dependency; tests override it or pass their own to create_app). Async: FastAPI
    runs a plain ``def`` dependency in its thread pool, a thread hand-off per request."""
    return request.app.state.settings
