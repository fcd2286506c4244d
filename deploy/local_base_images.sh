#!/bin/sh
# Offline substitute for the Containerfiles' Docker Hub base images, built
# from package registries only: for a machine that reaches Debian's mirrors
# and static.rust-lang.org but not Docker Hub. Where docker.io is reachable,
# do not use this: pull the real images.
#
# Makes, in local podman storage, under exactly the names the Containerfiles
# use (so they build unmodified with `podman build --pull=never`):
#   docker.io/library/debian:bookworm-slim
#       debootstrap --variant=minbase bookworm, with the official image's
#       apt sources (bookworm, bookworm-updates, bookworm-security) and its
#       dpkg/apt settings that keep docs and caches out of the image.
#   docker.io/library/rust:1.95-bookworm
#       that base plus the build packages of the official image (a subset of
#       buildpack-deps:bookworm: gcc, g++, make, libc6-dev, pkg-config, git,
#       curl, ...) and Rust 1.95.0 from rustup-init (sha256-checked), with the
#       official image's RUSTUP_HOME=/usr/local/rustup,
#       CARGO_HOME=/usr/local/cargo and PATH=/usr/local/cargo/bin:$PATH.
# They are not byte-identical to Docker Hub's images.
#
# Run as root (debootstrap). Environment:
#   MIRROR          Debian mirror (default http://deb.debian.org/debian)
#   PODMAN          podman command (default podman), e.g. "podman --runtime runc"
#   PODMAN_BUILD_ARGS extra `podman build` arguments (default --network=host)
#   FORCE=1         rebuild images that already exist
#   EXTRA_CA_CERTS  space-separated PEM files put in the base's
#                   /usr/local/share/ca-certificates/ (trusted once the
#                   ca-certificates package is installed, by the rust image
#                   here and by the Containerfiles' own installs): for a
#                   network whose egress proxy re-signs TLS (crates.io, PyPI
#                   and static.rust-lang.org are HTTPS). Images built with it
#                   trust that CA; do not ship them.
set -eu

MIRROR=${MIRROR:-http://deb.debian.org/debian}
PODMAN=${PODMAN:-podman}
PODMAN_BUILD_ARGS=${PODMAN_BUILD_ARGS:---network=host}
SLIM=docker.io/library/debian:bookworm-slim
RUST=docker.io/library/rust:1.95-bookworm
RUST_VERSION=1.95.0

exists() { $PODMAN image exists "$1" && [ "${FORCE:-0}" != 1 ]; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if exists "$SLIM"; then
  echo "$SLIM exists"
else
  root="$work/rootfs"
  debootstrap --variant=minbase bookworm "$root" "$MIRROR"
  rm -f "$root/etc/apt/sources.list"
  cat > "$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  # As the official slim image: no docs, man pages or locales from later
  # installs, no apt caches or package lists kept.
  cat > "$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
  cat > "$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  for ca in ${EXTRA_CA_CERTS:-}; do
    mkdir -p "$root/usr/local/share/ca-certificates"
    cp "$ca" "$root/usr/local/share/ca-certificates/$(basename "${ca%.*}").crt"
  done
  echo 'Acquire::Languages "none";' > "$root/etc/apt/apt.conf.d/docker-no-languages"
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin \
    "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*.log \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
  tar -C "$root" --numeric-owner -c . \
    | $PODMAN import --change 'CMD ["bash"]' - "$SLIM"
fi

if exists "$RUST"; then
  echo "$RUST exists"
else
  cat > "$work/Containerfile.rust" <<EOF
FROM $SLIM
RUN apt-get update \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
      ca-certificates curl wget gnupg netbase git openssh-client procps \\
      gcc g++ make libc6-dev pkg-config libssl-dev xz-utils bzip2 file \\
      patch unzip \\
 && rm -rf /var/lib/apt/lists/*
ENV RUSTUP_HOME=/usr/local/rustup \\
    CARGO_HOME=/usr/local/cargo \\
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    RUST_VERSION=$RUST_VERSION
RUN url=https://static.rust-lang.org/rustup/dist/x86_64-unknown-linux-gnu/rustup-init \\
 && curl -fsSLo /tmp/rustup-init "\$url" \\
 && echo "\$(curl -fsSL "\$url.sha256" | cut -d' ' -f1)  /tmp/rustup-init" | sha256sum -c - \\
 && chmod +x /tmp/rustup-init \\
 && /tmp/rustup-init -y --no-modify-path --profile minimal \\
      --default-toolchain \$RUST_VERSION --default-host x86_64-unknown-linux-gnu \\
 && rm /tmp/rustup-init \\
 && chmod -R a+w \$RUSTUP_HOME \$CARGO_HOME \\
 && rustup --version && cargo --version && rustc --version
CMD ["bash"]
EOF
  # shellcheck disable=SC2086
  $PODMAN build --pull=never $PODMAN_BUILD_ARGS -f "$work/Containerfile.rust" -t "$RUST" "$work"
fi
$PODMAN images --filter reference="$SLIM" --filter reference="$RUST"
