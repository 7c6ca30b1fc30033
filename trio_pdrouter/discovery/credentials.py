"""How to reach the Kubernetes API server: from a kubeconfig file, or from inside a pod.

Rules of this module:

* The kubeconfig comes first, as with kubectl and vllm-router's kube-rs client: ``--kubeconfig``,
  else ``$KUBECONFIG`` (its first file), else ``~/.kube/config`` if it exists; without one, the
  in-cluster service account (``KUBERNETES_SERVICE_HOST``/``_PORT``, and the token, CA and
  namespace under :data:`SERVICE_ACCOUNT`). Neither: :class:`NoCredentials`.
* From a kubeconfig: the current context's cluster (``server``; ``certificate-authority`` or
  ``-data``; ``insecure-skip-tls-verify``) and user (``token`` or ``tokenFile``;
  ``client-certificate``/``client-key`` or their ``-data``). Plain ``http://`` servers are
  allowed (a local API server). Exec and auth-provider plugins are not run: refused by name.
* A token from a file (in-cluster, ``tokenFile``) is read again by :meth:`Credentials.token` on
  every call, which the watch makes before every list and watch request: bound service-account
  tokens rotate (about hourly), and a token read once at start stops working.
"""

from __future__ import annotations

import base64
import os
import pathlib
import ssl
import tempfile
from collections.abc import Mapping
from typing import Any

import attrs
import yaml

SERVICE_ACCOUNT = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount")


class NoCredentials(Exception):
    """No kubeconfig and not in a pod, or a kubeconfig this client cannot use."""


@attrs.frozen
class Credentials:
    """The API server's base URL, how to trust it, and how to authenticate to it."""

    server: str
    tls: ssl.SSLContext | None = None
    static_token: str | None = None
    token_file: pathlib.Path | None = None
    #: The namespace the credentials belong to (in-cluster: the pod's), if known.
    namespace: str | None = None

    def token(self) -> str | None:
        """The bearer token, read from its file now if it has one (rotation, module doc)."""
        if self.token_file is not None:
            return self.token_file.read_text().strip()
        return self.static_token

    def headers(self) -> dict[str, str]:
        token = self.token()
        return {"authorization": f"Bearer {token}"} if token else {}


def load(kubeconfig: str | None = None, env: Mapping[str, str] = os.environ) -> Credentials:
    """The credentials to use (module doc); raises :class:`NoCredentials`."""
    path = kubeconfig or (env.get("KUBECONFIG") or "").split(os.pathsep)[0] or None
    if path is None:
        default = pathlib.Path(env.get("HOME", "~")).expanduser() / ".kube" / "config"
        path = str(default) if default.is_file() else None
    if path is not None:
        return from_kubeconfig(pathlib.Path(path))
    if env.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster(env)
    raise NoCredentials(
        "no kubeconfig (--kubeconfig, $KUBECONFIG, ~/.kube/config) and not running in a pod"
    )


def in_cluster(env: Mapping[str, str], root: pathlib.Path = SERVICE_ACCOUNT) -> Credentials:
    host, port = env["KUBERNETES_SERVICE_HOST"], env.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    tls = ssl.create_default_context(cafile=str(root / "ca.crt"))
    namespace_file = root / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.is_file() else None
    return Credentials(
        f"https://{host}:{port}", tls, token_file=root / "token", namespace=namespace
    )


def _named(config: Mapping[str, Any], kind: str, name: str) -> Mapping[str, Any]:
    for entry in config.get(f"{kind}s") or ():
        if entry.get("name") == name:
            return entry.get(kind) or {}
    raise NoCredentials(f"kubeconfig has no {kind} named {name!r}")


def _file_or_data(section: Mapping[str, Any], key: str, base: pathlib.Path) -> bytes | None:
    data = section.get(f"{key}-data")
    if data:
        return base64.b64decode(data)
    name = section.get(key)
    return (base / name).read_bytes() if name else None


def from_kubeconfig(path: pathlib.Path) -> Credentials:
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise NoCredentials(f"cannot read kubeconfig {path}: {exc}") from None
    context_name = config.get("current-context")
    if not context_name:
        raise NoCredentials(f"kubeconfig {path} has no current-context")
    context = _named(config, "context", context_name)
    cluster = _named(config, "cluster", context.get("cluster", ""))
    user = _named(config, "user", context["user"]) if context.get("user") else {}
    if "exec" in user or "auth-provider" in user:
        raise NoCredentials(
            f"kubeconfig {path}: exec and auth-provider credentials are not supported;"
            " use a token or a client certificate"
        )
    server = str(cluster.get("server", "")).rstrip("/")
    if not server.startswith(("http://", "https://")):
        raise NoCredentials(f"kubeconfig {path}: cluster server {server!r} is not a URL")
    base = path.parent
    tls = None
    if server.startswith("https://"):
        tls = _tls(cluster, user, base)
    token_file = user.get("tokenFile")
    return Credentials(
        server,
        tls,
        static_token=user.get("token"),
        token_file=base / token_file if token_file else None,
        namespace=context.get("namespace"),
    )


def _tls(cluster: Mapping[str, Any], user: Mapping[str, Any], base: pathlib.Path) -> ssl.SSLContext:
    tls = ssl.create_default_context()
    if cluster.get("insecure-skip-tls-verify"):
        tls.check_hostname = False
        tls.verify_mode = ssl.CERT_NONE
    ca = _file_or_data(cluster, "certificate-authority", base)
    if ca is not None:
        tls.load_verify_locations(cadata=ca.decode())
    cert = _file_or_data(user, "client-certificate", base)
    key = _file_or_data(user, "client-key", base)
    if cert is not None and key is not None:
        # ssl loads a certificate chain from files only: hand it private temporary ones.
        with tempfile.TemporaryDirectory() as tmp:
            cert_path, key_path = pathlib.Path(tmp, "cert.pem"), pathlib.Path(tmp, "key.pem")
            cert_path.write_bytes(cert)
            key_path.touch(mode=0o600)
            key_path.write_bytes(key)
            tls.load_cert_chain(cert_path, key_path)
    return tls
