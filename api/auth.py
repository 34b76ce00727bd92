"""API keys bound to tenants. No keys configured: no auth, everything is tenant ``default``."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import OpenAIError
from api.settings import Settings

DEFAULT_TENANT = "default"

_bearer = HTTPBearer(auto_error=False, description="API key (only when keys are configured)")


@dataclass(frozen=True)
class KeyStore:
    keys: tuple[tuple[bytes, str], ...] = ()  # (sha256 of the key, tenant)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def tenant_for(self, key: str) -> str | None:
        """Compare digests (equal lengths) against every key in constant time, no early exit on a match."""
        given = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found = None
        for known, tenant in self.keys:
            if hmac.compare_digest(given, known):
                found = tenant
        return found

    @classmethod
    def load(cls, settings: Settings) -> KeyStore:
        pairs = []
        if settings.api_keys_file:
            pairs += parse_keys_file(Path(settings.api_keys_file).read_text(encoding="utf-8"))
        if settings.api_keys:
            pairs += parse_keys_env(settings.api_keys)
        return cls.of(pairs)

    @classmethod
    def of(cls, pairs: list[tuple[str, str]]) -> KeyStore:
        return cls(tuple((hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in pairs))


def parse_keys_file(text: str) -> list[tuple[str, str]]:
    """Lines ``key tenant``; blank lines and ``#`` comments are skipped."""
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"api keys file line {number}: expected 'key tenant', got {len(fields)} fields")
        pairs.append((fields[0], fields[1]))
    return pairs


def parse_keys_env(value: str) -> list[tuple[str, str]]:
    """``key1:tenantA,key2:tenantB``."""
    pairs = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, tenant = item.rpartition(":")
        if not sep or not key or not tenant:
            raise ValueError("GAGGLE_API_KEYS entries must look like key:tenant")
        pairs.append((key, tenant))
    return pairs


async def get_tenant(request: Request,
                     credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> str:
    """The caller's tenant; 401 for a bad or missing key when keys are configured."""
    store: KeyStore = request.app.state.keys
    if not store.enabled:
        return DEFAULT_TENANT
    if credentials is None:
        raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    tenant = store.tenant_for(credentials.credentials)
    if tenant is None:
        raise OpenAIError(401, "invalid API key", code="invalid_api_key")
    return tenant
