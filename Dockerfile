# syntax=docker/dockerfile:1
# One image for paramserver, paramworker and paramctl.
#
#   docker build -t pdparams:0.1.0 .                                          # CPU torch (the default)
#   docker build -t pdparams:0.1.0-cuda --build-arg TORCH_INDEX_URL=URL .     # CUDA torch 2.13.0
#
# TORCH_INDEX_URL: PyTorch's wheel index for your CUDA version (its CUDA builds of torch 2.13.0 carry their
# own CUDA libraries; the host needs only the NVIDIA driver and container toolkit). Empty: torch==2.13.0
# from the default index, the CPU build, as the README installs it.
#
#   docker run --rm pdparams:0.1.0 paramserver serve --help
#   docker run --rm pdparams:0.1.0 paramworker serve --help
#
# Secrets never enter the image or its build: mount them as files at run time (--cluster-secret-file,
# --admin-token-file, --read-token-file; the worker's read_token_file in its client config).
# For reproducible builds, pin the base image by digest (python:3.11-slim-bookworm@sha256:...).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build: a virtual environment in /opt/pdparams
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdparams
# torch first, on purpose (see the README): the package's own pin then finds it installed.
RUN if [ -n "${TORCH_INDEX_URL}" ]; then \
        /opt/pdparams/bin/pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    else \
        /opt/pdparams/bin/pip install "torch==${TORCH_VERSION}"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY chunking ./chunking
COPY consensus ./consensus
COPY paramserver ./paramserver
COPY worker ./worker
COPY deploy ./deploy
# a regular (not editable) install: the runtime stage gets the venv only, not /src
RUN /opt/pdparams/bin/pip install . \
 && /opt/pdparams/bin/paramserver serve --help > /dev/null \
 && /opt/pdparams/bin/paramworker serve --help > /dev/null

# ---------------------------------------------------------------- runtime: the venv and an unprivileged user
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="pdparams" \
      org.opencontainers.image.description="Parameter-server cluster for model weights: paramserver, paramworker, paramctl" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 pdparams \
 && useradd --system --uid 10001 --gid pdparams --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin pdparams \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/paramserver /var/cache/paramworker
COPY --from=build /opt/pdparams /opt/pdparams
ENV PATH=/opt/pdparams/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /var/lib/paramserver
# gRPC, Raft (members only), bulk reads, worker HTTP, worker peer port (other workers only), metrics
EXPOSE 7000 7100 7200 7300 8080 9100
CMD ["paramserver", "serve", "--help"]
