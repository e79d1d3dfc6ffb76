# Multi-stage build: the agent is one static-ish binary on a slim base, run as non-root.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin sched-relay

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/sched-relay sched-relay \
    && mkdir -p /var/lib/sched-relay /var/log/sched-relay \
    && chown sched-relay /var/lib/sched-relay /var/log/sched-relay
COPY --from=build /src/target/release/sched-relay /usr/local/bin/sched-relay
USER sched-relay
ENTRYPOINT ["/usr/local/bin/sched-relay"]
CMD ["run"]
