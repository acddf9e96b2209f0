"""TLS server credentials that SIGHUP can renew without dropping a stream.

grpc's dynamic server credentials ask `CertificateStore.fetch` for a configuration at every new
TLS handshake: it answers None (keep the current one) until `reload()` has read new files, then
the new configuration once. Connections already open keep the session they negotiated, so a
certificate rotation never ends a running stream; the next connection gets the new certificate.

    CertificateStore(cert, key, client_ca)   read and checked at construction (ConfigError)
        .credentials()   grpc.ServerCredentials for add_secure_port
        .reload()        read the files again; on a problem keep serving the old ones (raises)
"""

from __future__ import annotations

import threading

import grpc

from service.credentials import TlsFiles, read_tls_files
from service.errors import ConfigError


def _configuration(files: TlsFiles) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(files.private_key, files.cert_chain)], root_certificates=files.client_ca)


class CertificateStore:
    """The certificate files of one server and the configuration its handshakes use."""

    def __init__(self, cert: str, key: str, client_ca: str = "") -> None:
        self._paths = (cert, key, client_ca)
        self._files = read_tls_files(*self._paths)
        self._lock = threading.Lock()    # fetch runs on gRPC's threads, reload on the loop's
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self.generation = 0              # reloads that took effect

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate (fixed for the server's life)."""
        return self._files.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            _configuration(self._files), self.fetch, require_client_authentication=self.mutual)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: the new configuration once after a reload."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def reload(self) -> None:
        """Reads the files again. ConfigError (the old certificate stays) when they do not load
        or would turn client authentication on or off, which needs a restart."""
        files = read_tls_files(*self._paths)
        if (files.client_ca is None) != (self._files.client_ca is None):
            raise ConfigError([("tls_client_ca_file", "mutual TLS cannot be turned on or off "
                                                      "by a reload; restart the server")])
        with self._lock:
            self._files = files
            self._pending = _configuration(files)
            self.generation += 1
