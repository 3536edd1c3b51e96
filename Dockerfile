# syntax=docker/dockerfile:1
# The treespec image the compose services run: `treespec draft|verify|openai ...`.
# PyPI's Linux x86_64 torch wheels bundle the CUDA runtime, so a plain Python base is
# enough on a host with the NVIDIA driver and container toolkit. BASE_IMAGE can point
# at a CUDA/PyTorch image instead (e.g. one whose grpcio/protobuf match the stubs).
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

WORKDIR /opt/treespec
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY common ./common
COPY kernels ./kernels
COPY draft_service ./draft_service
COPY verify_service ./verify_service
RUN pip install . \
    && useradd --create-home --uid 10001 treespec

USER treespec
# gRPC (verify 50051, draft 50052), /metrics (verify 9400, draft 9401) and the OpenAI
# front's HTTP (8000); compose sets them.
EXPOSE 50051 50052 9400 9401 8000
ENTRYPOINT ["treespec"]
CMD ["--help"]
