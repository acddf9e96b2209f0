# syntax=docker/dockerfile:1
# The Shepherd Model Gateway (PyPI smg) that fronts the specstream workers: an OpenAI-compatible
# HTTP API, load balancing, retries and Kubernetes discovery of the worker pods.
# Build from the repository root:
#   docker build -f deploy/gateway.Dockerfile -t specstream-gateway:1.13.0 .
FROM python:3.12-slim-bookworm
ARG SMG_VERSION=1.13.0
RUN pip install --no-cache-dir "smg==${SMG_VERSION}" \
 && groupadd --system --gid 10001 smg \
 && useradd --system --uid 10001 --gid smg --no-create-home --shell /usr/sbin/nologin smg
USER 10001:10001
EXPOSE 30000 30001 29000
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:30001/liveness', timeout=2)"]
ENTRYPOINT ["smg", "launch"]
CMD ["--host", "0.0.0.0", "--port", "30000", "--health-check-port", "30001", \
     "--prometheus-host", "0.0.0.0", "--prometheus-port", "29000"]
