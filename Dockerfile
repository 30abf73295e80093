# syntax=docker/dockerfile:1
# One image for the whole mesh: the four services and the kvmesh CLI
# (migrate, probe, sim, dlq, ...). docker-compose.yml picks the program of
# each service with `entrypoint`.

# The Go version matches go.mod; bookworm matches the runtime's glibc.
FROM golang:1.26-bookworm AS build
WORKDIR /src
# Modules first, in a layer of their own: it is rebuilt only when
# go.mod or go.sum change.
COPY go.mod go.sum ./
RUN go mod download && go mod verify
COPY . .
# lookup, scheduler, sender and the CLI are pure Go.
RUN --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/ \
        ./cmd/kvmesh ./services/lookup ./services/scheduler ./services/sender
# gpuworker reads the GPU inventory through go-nvml, which needs cgo (it
# dlopens libnvidia-ml at run time, so the image works without a GPU too).
RUN --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=1 CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations" \
    go build -trimpath -ldflags="-s -w" -o /out/ ./services/gpuworker

# distroless/base has glibc (for the cgo-built gpuworker) and nothing else:
# no shell, no package manager. Health checks use `kvmesh probe`.
FROM gcr.io/distroless/base-debian12:nonroot
COPY --from=build /out/ /usr/local/bin/
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/kvmesh"]
CMD ["help"]
