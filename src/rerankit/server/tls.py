"""HTTPS for ``rerankit serve``: the certificate and key it presents, and optionally the CA whose client certificates
it requires (mutual TLS). The files are read before the model loads, so a wrong path or a key that does not match
its certificate ends the command at once with a message naming the flag."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

from rerankit.errors import RerankitError


@dataclass(frozen=True)
class Tls:
    """``certfile`` (PEM, the chain the server presents), ``keyfile`` (PEM; None: the key is in ``certfile``),
    ``keyfile_password``, ``ca_certs`` (PEM CAs: clients must present a certificate one of them signed)."""

    certfile: str
    keyfile: str | None = None
    keyfile_password: str | None = None
    ca_certs: str | None = None

    def check(self) -> None:
        """``RerankitError`` naming the flag unless the files load as uvicorn will load them."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.certfile, self.keyfile, self.keyfile_password)
        except (OSError, ssl.SSLError) as exc:
            flags = "--ssl-certfile" + ("" if self.keyfile is None else " and --ssl-keyfile")
            raise RerankitError(f"{flags}: cannot load the certificate and its key ({_reason(exc)})") from None
        if self.ca_certs is not None:
            try:
                context.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as exc:
                raise RerankitError(f"--ssl-ca-certs: cannot load {self.ca_certs} ({_reason(exc)})") from None

    def uvicorn_options(self) -> dict[str, Any]:
        """The ``uvicorn.Config`` arguments that serve HTTPS with these files."""
        options: dict[str, Any] = {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile,
                                   "ssl_keyfile_password": self.keyfile_password}
        if self.ca_certs is not None:
            options.update(ssl_ca_certs=self.ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options


def tls_of(certfile: str | None, keyfile: str | None = None, keyfile_password: str | None = None,
           ca_certs: str | None = None) -> Tls | None:
    """The ``Tls`` of the ``--ssl-*`` flags, None for plain HTTP; a key or a CA without a certificate is an error."""
    if certfile is None:
        given = [flag for flag, value in (("--ssl-keyfile", keyfile), ("--ssl-keyfile-password", keyfile_password),
                                          ("--ssl-ca-certs", ca_certs)) if value is not None]
        if given:
            raise RerankitError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --ssl-certfile (the certificate the server presents)")
        return None
    return Tls(certfile, keyfile, keyfile_password, ca_certs)


def _reason(exc: Exception) -> str:
    """An ssl or OS error in a few words."""
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
