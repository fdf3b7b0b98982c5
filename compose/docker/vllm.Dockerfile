# vLLM 0.33 with the kvsidecar extension (GPU path: CudaBackend). Build from the
# repository root:
#
#   docker build -f compose/docker/vllm.Dockerfile -t kvsidecar/vllm:0.33.0 .
#
# kvsidecar[cuda] is installed at build time (nothing is installed when a
# container starts) next to the image's own vLLM and torch, which are pinned
# (constraints from `pip list`: the engine, torch and their kernels) so pip
# cannot replace them. The plugin registers through vLLM's
# `vllm.general_plugins` entry point and acts only with KVSIDECAR_ENABLE=1.
FROM vllm/vllm-openai:v0.33.0

WORKDIR /opt/kvsidecar
COPY pyproject.toml README.md ./
COPY allocator ./allocator
COPY engine_ext ./engine_ext
COPY sidecar ./sidecar
RUN python3 -m pip list --format=freeze \
    | grep -iE '^(torch|torchvision|torchaudio|triton|vllm|sglang|sgl-kernel|flashinfer[a-z_-]*|xformers|transformers)==' \
    > /tmp/image-pins.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/image-pins.txt ".[cuda]" \
 && python3 -c "import vllm, engine_ext.vllm.plugin, cuda.bindings.driver; print('vllm', vllm.__version__)" \
 && rm /tmp/image-pins.txt

WORKDIR /
ENTRYPOINT ["vllm", "serve"]
