# The kvsidecar control plane (no GPU). Build from the repository root:
#
#   docker build -f compose/docker/sidecar.Dockerfile -t kvsidecar/sidecar:0.1.0 .
#
# Everything is installed at build time; the container runs `kvsidecar serve`.
FROM python:3.11-slim

WORKDIR /opt/kvsidecar
COPY pyproject.toml README.md ./
COPY allocator ./allocator
COPY engine_ext ./engine_ext
COPY sidecar ./sidecar
RUN pip install --no-cache-dir . \
 && kvsidecar --help > /dev/null

ENV KVSIDECAR_DB_PATH=/var/lib/kvsidecar/sidecar.db
EXPOSE 8570
HEALTHCHECK --interval=5s --timeout=3s --retries=30 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:8570/healthz')"]
ENTRYPOINT ["kvsidecar"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8570"]
