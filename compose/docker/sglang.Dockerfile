# SGLang 0.5.23 with the kvsidecar extension (GPU path: CudaBackend). Build from
# the repository root:
#
#   docker build -f compose/docker/sglang.Dockerfile -t kvsidecar/sglang:0.5.23 .
#
# kvsidecar[cuda] is installed at build time (nothing is installed when a
# container starts) next to the image's own SGLang and torch, which are pinned
# (constraints from `pip list`: the engine, torch and their kernels) so pip
# cannot replace them. The entry point is the kvsidecar launcher, which
# installs the adapter (with KVSIDECAR_ENABLE=1) and runs SGLang's own HTTP
# server; pass SGLang's arguments, including --page-size 16, as the command.
FROM lmsysorg/sglang:v0.5.23

WORKDIR /opt/kvsidecar
COPY pyproject.toml README.md ./
COPY allocator ./allocator
COPY engine_ext ./engine_ext
COPY sidecar ./sidecar
RUN python3 -m pip list --format=freeze \
    | grep -iE '^(torch|torchvision|torchaudio|triton|vllm|sglang|sgl-kernel|flashinfer[a-z_-]*|xformers|transformers)==' \
    > /tmp/image-pins.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/image-pins.txt ".[cuda]" \
 && python3 -c "import sglang, engine_ext.sglang.launch_server, cuda.bindings.driver; print('sglang', sglang.__version__)" \
 && rm /tmp/image-pins.txt

WORKDIR /
ENTRYPOINT ["python3", "-m", "engine_ext.sglang.launch_server"]
