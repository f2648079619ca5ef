#!/usr/bin/env bash
# A self-contained X desktop (Xvfb, openbox, xterm, mousepad, xdotool, xkbcomp) for a Linux x86-64 machine
# that has no network, no apt and an unknown distro: the bundle carries Debian bookworm's programs with
# their own glibc and dynamic loader, so it needs nothing of the machine but the kernel (and /bin/sh).
#
#   scripts/desktop-bundle.sh prepare [OUTFILE]   # here, with apt: builds OUTFILE (default .whl/dart-x.tar.xz)
#   scripts/desktop-bundle.sh install [FILE]      # there, as root, no network (default .whl/dart-x.tar.xz)
#   scripts/desktop-bundle.sh check               # there, after install: starts the desktop and looks at it
#
# prepare: `apt-get install --download-only`s the bookworm packages of the six programs with their whole
#   dependency closure (an empty dpkg status, so nothing counts as installed), unpacks them (but not the
#   packages nothing here loads: DENY), and copies into a staging /opt/dart-x only what is loaded: the
#   programs, the closure of their DT_NEEDED libraries (glibc and ld.so included) flattened into lib/, the
#   modules they dlopen (a few gdk-pixbuf and imlib2 loaders, some gconv modules), and the data they read
#   (XKB data, X11 locale, DejaVu fonts with a fontconfig configuration of their own, compiled GSettings
#   schemas, a gdk-pixbuf loaders cache, a compact MIME cache, gtksourceview's language specs and styles,
#   openbox's rc.xml, menu.xml and theme). No icon themes, translations, docs, man pages, GL drivers.
#   libicudata (31 MB: ICU's data, linked by libxml2 for gtksourceview, and used only to convert encodings
#   that iconv lacks) is replaced by a stub of the same soname holding an empty ICU data package when a C
#   compiler is at hand (DART_X_ICU=full keeps the real one). The X client libraries that mss loads with
#   ctypes (libX11, libxcb and its randr/render/shm/xfixes parts, Xext, Xfixes, Xrandr, Xrender and their
#   dependencies, not glibc) also go to client/, for the machine's own loader. It writes the wrappers
#   (wrappers/: each sets the environment its program needs and execs it as
#   `lib64/ld-linux-x86-64.so.2 --inhibit-cache --library-path lib usr/bin/PROG "$@"`), writes install.sh,
#   packs dart-x/ as one tar.xz and prints its size. Adds /.whl/ to .git/info/exclude.
# install: unpacks FILE to /opt/dart-x (replacing an earlier one) and runs its install.sh: the wrappers go
#   to /usr/local/bin; /usr/bin/xkbcomp (Xvfb's compiled-in path), /usr/share/X11/xkb and
#   /etc/xdg/openbox/rc.xml are written only where absent (system files are never overwritten); the
#   client libraries the system lacks (by soname, per `ldconfig -p`) are linked into /opt/dart-x/client-ld,
#   registered in /etc/ld.so.conf.d/dart-x.conf, and ldconfig runs, so ctypes.util.find_library finds them
#   without any system library being shadowed. Idempotent. The bundle alone does the same:
#   `tar -xJf dart-x.tar.xz -C /opt && /opt/dart-x/install.sh`.
# check: starts `Xvfb :77 -screen 0 1920x1080x24 -nolisten tcp`, openbox, xterm and mousepad on it (as user
#   nobody when setpriv or runuser can switch to it), waits up to $DART_X_CHECK_TIMEOUT s (default 20) for
#   xdotool to find a visible xterm and Mousepad window, checks that every process still runs, takes an
#   mss screenshot of the root window with python3 (skipped with a notice where python3 or mss is
#   missing), then kills them all. Exits nonzero with a message on any failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_BUNDLE="$ROOT/.whl/dart-x.tar.xz"
PREFIX=/opt/dart-x
SUITE_PACKAGES="xvfb openbox xterm mousepad xdotool x11-xkb-utils xkb-data fonts-dejavu-core fontconfig
  libglib2.0-bin libgdk-pixbuf-2.0-0 shared-mime-info"
# Never unpacked: in the closure through maintainer scripts, recommends-like dependencies or GL, but
# nothing the bundle runs loads them.
DENY='^(libllvm|libz3-|libgl1-mesa-dri|libglx-mesa0|fonts-urw|adwaita-icon-theme|hicolor-icon-theme|perl|libperl|python3|libpython|systemd|libsystemd-shared|libpam|dbus|poppler-data|libgs10|libgs-common|dpkg_|tar_|passwd_|procps_|mount_|util-linux|adduser|debconf|ucf_|usrmerge|init-system|sysvinit|libheif|libde265|libx265|libaom|libdav1d|libjxl|libhwy|libhunspell|hunspell|libaspell|libenchant|dictionaries-common|emacsen|libgspell|libcups|libcolord|liblcms2|libavahi|libspectre|libidn12|libijs|libjbig2dec|libopenjp2|libpaper)'
PROGRAMS="Xvfb openbox xterm mousepad xdotool xkbcomp"
die() { echo "desktop-bundle: $*" >&2; exit 1; }

prepare() {
  local out="${1:-$DEFAULT_BUNDLE}"
  command -v apt-get >/dev/null || die "prepare needs apt-get (Debian bookworm)"
  case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
  mkdir -p "$(dirname "$out")"
  if [ "$out" = "$DEFAULT_BUNDLE" ] && [ -d "$ROOT/.git" ]; then
    grep -qxF '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.whl/' >>"$ROOT/.git/info/exclude"
  fi
  local tmp
  tmp="$(mktemp -d /tmp/dart-x-prepare.XXXXXX)"
  trap "rm -rf '$tmp'" EXIT
  mkdir -p "$tmp/debs/partial" "$tmp/root" "$tmp/stage"
  : >"$tmp/status"
  echo "== downloading the bookworm packages and their closure"
  # shellcheck disable=SC2086
  apt-get -q -o Dir::State::status="$tmp/status" -o Dir::Cache::archives="$tmp/debs" \
    -o APT::Install-Recommends=false -o Debug::NoLocking=1 install --download-only -y $SUITE_PACKAGES >"$tmp/apt.log" 2>&1 \
    || { tail -20 "$tmp/apt.log"; die "apt-get download failed (apt-get update first?)"; }
  local deb n=0
  for deb in "$tmp"/debs/*.deb; do
    if basename "$deb" | grep -Eq "$DENY"; then continue; fi
    dpkg-deb -x "$deb" "$tmp/root"
    n=$((n + 1))
  done
  echo "   $(find "$tmp/debs" -name '*.deb' | wc -l) packages downloaded, $n unpacked"
  echo "== assembling $PREFIX"
  python3 - "$tmp" "$PREFIX" "${DART_X_ICU:-stub}" <<'EOF'
import os, re, shutil, stat, subprocess, sys
from pathlib import Path

tmp, prefix, icu_mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
src, dst = tmp / "root", tmp / "stage" / "dart-x"
ARCH = "x86_64-linux-gnu"
LIBDIRS = [src / "lib" / ARCH, src / "usr/lib" / ARCH, src / "lib64"]
GLIBC = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "ld-linux-x86-64.so.2",
         "libresolv.so.2", "libutil.so.1", "libanl.so.1"}
used = set()  # source paths copied, for the package list


def needed(path):
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def find_lib(name):
    for d in LIBDIRS:
        if (d / name).exists():
            return d / name
    raise SystemExit(f"library {name} not found in the unpacked packages")


def closure(seeds, skip=frozenset()):
    libs, todo = {}, [n for s in seeds for n in needed(s)]
    while todo:
        name = todo.pop()
        if name in libs or name in skip:
            continue
        libs[name] = find_lib(name)
        todo += needed(libs[name])
    return libs


def inroot(p):
    """p with its symbolic links resolved inside the unpacked tree (absolute ones point into it)."""
    p = Path(p)
    for _ in range(40):
        if not p.is_symlink():
            return p
        t = os.readlink(p)
        p = src / t.lstrip("/") if t.startswith("/") else p.parent / t
    raise SystemExit(f"symbolic link loop at {p}")


def copy(s, d, mode=None):
    s = Path(s)
    d.parent.mkdir(parents=True, exist_ok=True)
    real = inroot(s)
    used.add(real)
    used.add(s)
    shutil.copyfile(real, d)
    os.chmod(d, mode if mode is not None else (0o755 if os.access(real, os.X_OK) else 0o644))


def copytree(s, d, keep=lambda p: True):
    for p in sorted(Path(s).rglob("*")):
        if p.is_file() and keep(p):
            copy(p, d / p.relative_to(s))


gtkmods = src / "usr/lib" / ARCH / "gdk-pixbuf-2.0/2.10.0/loaders"
pixbuf = [gtkmods / f"libpixbufloader-{n}.so" for n in ("xpm", "gif", "bmp", "ico", "xbm", "pnm", "ani")]
imlib = [src / "usr/lib" / ARCH / "imlib2/loaders" / f"{n}.so" for n in ("png", "xpm", "gif", "bmp", "ico")]
gconvdir = src / "usr/lib" / ARCH / "gconv"
gconv = [p for p in gconvdir.glob("*.so") if re.match(r"(UTF-|UNICODE|UTF7|ISO8859-|CP125|KOI8-R|LATIN)", p.name)]
programs = ["Xvfb", "openbox", "xterm", "mousepad", "xdotool", "xkbcomp", "fc-cache"]
seeds = [src / "usr/bin" / p for p in programs] + pixbuf + imlib + gconv

libs = closure(seeds)
for name, path in libs.items():
    if name != "ld-linux-x86-64.so.2":
        copy(path, dst / "lib" / name)
copy(find_lib("ld-linux-x86-64.so.2"), dst / "lib64/ld-linux-x86-64.so.2", 0o755)
for p in programs:
    copy(src / "usr/bin" / p, dst / "usr/bin" / p, 0o755)
for p in pixbuf:
    copy(p, dst / "lib/gdk-pixbuf/loaders" / p.name)
for p in imlib:
    copy(p, dst / "lib/imlib2/loaders" / p.name)
for p in gconv:
    copy(p, dst / "lib/gconv" / p.name)
copy(gconvdir / "gconv-modules", dst / "lib/gconv/gconv-modules")
copytree(gconvdir / "gconv-modules.d", dst / "lib/gconv/gconv-modules.d")
(dst / "lib/gio/modules").mkdir(parents=True)
(dst / "lib/gtk-3.0").mkdir(parents=True)
(dst / "lib/gtk-3.0/immodules.cache").write_text("# no input method modules: GTK's built-in ones\n")

# The client libraries mss loads (xcb backend; the legacy xlib one too), for the system's own glibc.
client = {}
todo = ["libX11.so.6", "libxcb.so.1", "libxcb-randr.so.0", "libxcb-render.so.0", "libxcb-shm.so.0",
        "libxcb-xfixes.so.0", "libXext.so.6", "libXfixes.so.3", "libXrandr.so.2", "libXrender.so.1"]
while todo:
    name = todo.pop()
    if name in client or name in GLIBC:
        continue
    client[name] = find_lib(name)
    todo += needed(client[name])
(dst / "client").mkdir()
for name, path in client.items():
    if (dst / "lib" / name).exists():
        os.link(dst / "lib" / name, dst / "client" / name)  # one copy in the tar
    else:
        copy(path, dst / "client" / name)

# ICU: libxml2 links libicuuc, which links libicudata (31 MB of ICU data). libxml2 calls ICU only to
# open converters for encodings iconv lacks; an empty data package makes those fail cleanly.
icudata = "libicudata.so.72"
if icu_mode == "stub" and icudata in libs and shutil.which("cc"):
    c = tmp / "icustub.c"
    # ICU common data ("CmnD" 1.0): MappedData + UDataInfo header (32 bytes), then a TOC of 0 entries.
    c.write_text(r'''
#include <stdint.h>
const struct { uint16_t headerSize; uint8_t magic1, magic2; uint16_t size, reserved;
  uint8_t bigEndian, charset, sizeofUChar, reservedByte, dataFormat[4], formatVersion[4], dataVersion[4];
  uint32_t padding[2]; uint32_t count; } icudt72_dat __attribute__((aligned(16))) =
  { 32, 0xda, 0x27, 20, 0, 0, 0, 2, 0, {'C','m','n','D'}, {1,0,0,0}, {72,1,0,0}, {0,0}, 0 };
''')
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wl,-soname," + icudata, "-nostdlib",
                    "-o", str(dst / "lib" / icudata), str(c)], check=True)
    os.chmod(dst / "lib" / icudata, 0o644)
    print("   libicudata: an empty ICU data package (DART_X_ICU=full keeps the real one)")

# Data.
share, dshare = src / "usr/share", dst / "usr/share"
copytree(share / "X11/xkb", dshare / "X11/xkb")
copytree(share / "X11/locale", dshare / "X11/locale")
copy(share / "X11/XErrorDB", dshare / "X11/XErrorDB")
copytree(src / "etc/X11/app-defaults", dst / "etc/X11/app-defaults", lambda p: p.name.startswith(("XTerm", "UXTerm")))
copytree(share / "fonts/truetype/dejavu", dshare / "fonts/truetype/dejavu")
for p in sorted((src / "etc/fonts/conf.d").iterdir()):
    if p.suffix == ".conf":
        copy(p, dst / "etc/fonts/conf.d" / p.name)
(dst / "etc/fonts/fonts.conf").write_text(f'''<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "urn:fontconfig:fonts.dtd">
<!-- dart-x: the bundle's fonts first, then the system's -->
<fontconfig>
  <dir>{prefix}/usr/share/fonts</dir>
  <dir>/usr/share/fonts</dir>
  <dir>/usr/local/share/fonts</dir>
  <dir prefix="xdg">fonts</dir>
  <cachedir>/var/cache/dart-x/fontconfig</cachedir>
  <cachedir prefix="xdg">fontconfig</cachedir>
  <include ignore_missing="yes">{prefix}/etc/fonts/conf.d</include>
</fontconfig>
''')
schemas = [p for p in (share / "glib-2.0/schemas").glob("*.gschema.xml") if "gspell" not in p.name]
for p in schemas:
    copy(p, dshare / "glib-2.0/schemas" / p.name)
copytree(share / "gtksourceview-4", dshare / "gtksourceview-4")
rc = (src / "etc/xdg/openbox/rc.xml").read_text()
theme = re.search(r"<theme>\s*<name>([^<]+)</name>", rc).group(1)
copytree(share / "themes" / theme, dshare / "themes" / theme)
for n in ("rc.xml", "menu.xml"):
    copy(src / "etc/xdg/openbox" / n, dst / "etc/xdg/openbox" / n)
copy(share / "mime/packages/freedesktop.org.xml", dshare / "mime/packages/freedesktop.org.xml")

# Tools run here, from the unpacked packages, through their own loader.
ld = [str(find_lib("ld-linux-x86-64.so.2")), "--inhibit-cache", "--library-path", ":".join(map(str, LIBDIRS))]
subprocess.run(ld + [str(src / "usr/bin/glib-compile-schemas"), str(dshare / "glib-2.0/schemas")], check=True)
subprocess.run(ld + [str(src / "usr/bin/update-mime-database"), str(dshare / "mime")], check=True,
               env=dict(os.environ, PKGSYSTEM_ENABLE_FSYNC="0", XDG_DATA_DIRS=str(dshare)))
for p in (dshare / "mime").iterdir():  # mime.cache and the flat files; no per-type descriptions
    if p.is_dir():
        shutil.rmtree(p)
query = src / "usr/lib" / ARCH / "gdk-pixbuf-2.0/gdk-pixbuf-query-loaders"
cache = subprocess.run(ld + [str(query)] + [str(dst / "lib/gdk-pixbuf/loaders" / p.name) for p in pixbuf],
                       capture_output=True, text=True, check=True).stdout
(dst / "lib/gdk-pixbuf/loaders.cache").write_text(cache.replace(str(dst), prefix))

# Which packages the bundle holds.
owner = {}
for deb in sorted((tmp / "debs").glob("*.deb")):
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True).stdout
    pkg = deb.name.split("_")[0] + " " + deb.name.split("_")[1].replace("%3a", ":")
    for line in listing.splitlines():
        owner.setdefault(str(src / line.split(" ./", 1)[-1].split(" -> ")[0].rstrip("/")), pkg)
pkgs = sorted({owner[str(p)] for p in used if str(p) in owner})
(dst / "PACKAGES").write_text("".join(p + "\n" for p in pkgs))
print(f"   {len(libs)} libraries, {len(client)} client libraries, {len(pkgs)} packages")
EOF
  write_bundle_scripts "$tmp/stage/dart-x"
  chmod -R a+rX,go-w "$tmp/stage/dart-x"
  echo "== packing $out"
  tar -C "$tmp/stage" --owner=0 --group=0 --numeric-owner --sort=name -cf - dart-x | xz -9e -T0 >"$out.part"
  mv "$out.part" "$out"
  echo "   unpacked $(du -sh "$tmp/stage/dart-x" | cut -f1); bundle $(du -h "$out" | cut -f1) ($(stat -c %s "$out") bytes): $out"
}

# The wrappers and install.sh, into the staging dart-x/ ($1).
write_bundle_scripts() {
  local d="$1" p
  mkdir -p "$d/wrappers"
  # Per program: the environment it needs. Programs that spawn others (openbox, xterm) get only what is
  # harmless to pass on to the system's programs; the GTK and gconv settings are mousepad's alone.
  local x11="export XLOCALEDIR=$PREFIX/usr/share/X11/locale"
  local fc="export FONTCONFIG_FILE=$PREFIX/etc/fonts/fonts.conf FONTCONFIG_PATH=$PREFIX/etc/fonts"
  local data="export XDG_DATA_DIRS=$PREFIX/usr/share:\${XDG_DATA_DIRS:-/usr/local/share:/usr/share}"
  for p in $PROGRAMS; do
    {
      echo '#!/bin/sh'
      echo "# dart-x wrapper (scripts/desktop-bundle.sh): $p from Debian bookworm with the bundle's own glibc."
      echo "D=$PREFIX"
      case "$p" in
        Xvfb) echo "# No GLX: the bundle has no GL drivers, and the system's must not be loaded into it." ;;
        xkbcomp | xdotool) echo "$x11" ;;
        xterm)
          echo "$x11"
          echo "$fc"
          echo "export XFILESEARCHPATH=\$D/etc/X11/%T/%N%C%S:\$D/etc/X11/%T/%N%S:\${XFILESEARCHPATH:-/etc/X11/%L/%T/%N%C%S:/etc/X11/%l/%T/%N%C%S:/etc/X11/%T/%N%C%S:/etc/X11/%L/%T/%N%S:/etc/X11/%l/%T/%N%S:/etc/X11/%T/%N%S}"
          ;;
        openbox)
          echo "$x11"
          echo "$fc"
          echo "$data"
          echo "export XDG_CONFIG_DIRS=\${XDG_CONFIG_DIRS:-/etc/xdg}:\$D/etc/xdg IMLIB2_LOADER_PATH=\$D/lib/imlib2/loaders"
          ;;
        mousepad)
          echo "$x11"
          echo "$fc"
          echo "$data"
          echo "export GSETTINGS_SCHEMA_DIR=\$D/usr/share/glib-2.0/schemas GIO_MODULE_DIR=\$D/lib/gio/modules"
          echo "export GDK_PIXBUF_MODULE_FILE=\$D/lib/gdk-pixbuf/loaders.cache GDK_PIXBUF_MODULEDIR=\$D/lib/gdk-pixbuf/loaders"
          echo "export GTK_EXE_PREFIX=\$D/usr GTK_DATA_PREFIX=\$D/usr GTK_PATH=\$D/lib/gtk-3.0 GTK_IM_MODULE_FILE=\$D/lib/gtk-3.0/immodules.cache"
          echo "export GCONV_PATH=\$D/lib/gconv NO_AT_BRIDGE=1 GTK_A11Y=none"
          echo "unset GTK_MODULES GTK3_MODULES GTK_IM_MODULE"
          ;;
      esac
      local extra=""
      if [ "$p" = Xvfb ]; then extra=" -extension GLX"; fi
      echo "exec \"\$D/lib64/ld-linux-x86-64.so.2\" --inhibit-cache --library-path \"\$D/lib\" --argv0 \"\$0\" \"\$D/usr/bin/$p\"$extra \"\$@\""
    } >"$d/wrappers/$p"
    chmod 755 "$d/wrappers/$p"
  done
  cat >"$d/install.sh" <<EOF
#!/bin/sh
# Installs the dart-x bundle unpacked at $PREFIX (scripts/desktop-bundle.sh): wrappers in /usr/local/bin,
# /usr/bin/xkbcomp, /usr/share/X11/xkb and /etc/xdg/openbox/rc.xml where absent, the X client libraries
# the system lacks registered with its loader. Idempotent; never overwrites a file that is not its own.
set -eu
D=$PREFIX
MARK='# dart-x wrapper'
[ "\$(id -u)" = 0 ] || { echo "dart-x install: run as root" >&2; exit 1; }
ours() { [ ! -e "\$1" ] || grep -q "\$MARK" "\$1" 2>/dev/null; }
mkdir -p /usr/local/bin
for w in "\$D"/wrappers/*; do
  t=/usr/local/bin/\$(basename "\$w")
  if ours "\$t"; then cp "\$w" "\$t.dart-x" && chmod 755 "\$t.dart-x" && mv -f "\$t.dart-x" "\$t"
  else echo "dart-x install: \$t exists and is not a dart-x wrapper: left alone" >&2; fi
done
if ours /usr/bin/xkbcomp; then cp "\$D/wrappers/xkbcomp" /usr/bin/xkbcomp.dart-x && mv -f /usr/bin/xkbcomp.dart-x /usr/bin/xkbcomp
else echo "dart-x install: /usr/bin/xkbcomp is the system's: kept"; fi
if [ ! -e /usr/share/X11/xkb ]; then mkdir -p /usr/share/X11 && cp -a "\$D/usr/share/X11/xkb" /usr/share/X11/xkb
else echo "dart-x install: /usr/share/X11/xkb exists: kept"; fi
if [ ! -e /etc/xdg/openbox/rc.xml ]; then mkdir -p /etc/xdg/openbox && cp "\$D/etc/xdg/openbox/rc.xml" /etc/xdg/openbox/rc.xml
else echo "dart-x install: /etc/xdg/openbox/rc.xml exists: kept"; fi
# Client libraries for the system's python (mss): only sonames the system's loader does not know already.
rm -rf "\$D/client-ld" && mkdir "\$D/client-ld"
known=\$(ldconfig -p | awk '\$NF !~ "^$PREFIX/" {print \$1}')
for f in "\$D"/client/*; do
  n=\$(basename "\$f")
  if printf '%s\n' "\$known" | grep -qxF "\$n"; then echo "dart-x install: the system has \$n: using it"
  else ln -s "../client/\$n" "\$D/client-ld/\$n"; fi
done
echo "\$D/client-ld" >/etc/ld.so.conf.d/dart-x.conf
ldconfig
# Xvfb run as a user cannot create X's socket directory (x11-common makes it where X is installed).
[ -d /tmp/.X11-unix ] || install -d -m 1777 /tmp/.X11-unix
mkdir -p /var/cache/dart-x/fontconfig
FONTCONFIG_FILE=\$D/etc/fonts/fonts.conf "\$D/lib64/ld-linux-x86-64.so.2" --inhibit-cache --library-path "\$D/lib" "\$D/usr/bin/fc-cache" -s "\$D/usr/share/fonts" || true
chmod -R a+rX /var/cache/dart-x
echo "dart-x installed: \$(ls "\$D/wrappers" | tr '\n' ' ')in /usr/local/bin; client libraries: \$(ls "\$D/client-ld" | wc -l) registered"
EOF
  chmod 755 "$d/install.sh"
}

install_bundle() {
  local file="${1:-$DEFAULT_BUNDLE}"
  [ "$(id -u)" = 0 ] || die "install needs root"
  [ -f "$file" ] || die "no bundle at $file (scripts/desktop-bundle.sh prepare makes it)"
  local parent new
  parent="$(dirname "$PREFIX")"
  mkdir -p "$parent"
  new="$(mktemp -d "$parent/.dart-x.XXXXXX")"
  # tar -J needs the xz program, which minimal systems may lack; python3's tarfile reads xz as well.
  if command -v xz >/dev/null; then
    tar -xJf "$file" -C "$new" --no-same-owner || { rm -rf "$new"; die "cannot unpack $file"; }
  elif command -v python3 >/dev/null && python3 -c 'import lzma' 2>/dev/null; then
    python3 -c 'import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    t.extractall(sys.argv[2], **({"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}))' \
      "$file" "$new" || { rm -rf "$new"; die "cannot unpack $file"; }
  else
    rm -rf "$new"
    die "unpacking $file needs xz or python3 (with lzma)"
  fi
  [ -x "$new/dart-x/install.sh" ] || { rm -rf "$new"; die "$file is not a dart-x bundle"; }
  rm -rf "$PREFIX"
  mv "$new/dart-x" "$PREFIX"
  rmdir "$new"
  chmod 755 "$PREFIX"
  "$PREFIX/install.sh"
}

# Kills what check started ($pids, TERM then KILL), removes its directory ($1) and display :$2's lock.
check_cleanup() {
  local i
  for i in "${pids[@]}"; do kill -TERM "$i" 2>/dev/null || true; done
  sleep 0.5
  for i in "${pids[@]}"; do kill -KILL "$i" 2>/dev/null || true; done
  for i in "${pids[@]}"; do wait "$i" 2>/dev/null || true; done
  rm -rf "$1"
  rm -f "/tmp/.X$2-lock" "/tmp/.X11-unix/X$2"
}

check() {
  local dpy=77 timeout="${DART_X_CHECK_TIMEOUT:-20}" p
  for p in $PROGRAMS; do command -v "$p" >/dev/null || die "$p is not on PATH (install first)"; done
  [ -x /usr/bin/xkbcomp ] || die "/usr/bin/xkbcomp is missing (Xvfb runs it)"
  [ -d /usr/share/X11/xkb ] || die "/usr/share/X11/xkb is missing"
  if [ -e "/tmp/.X$dpy-lock" ]; then
    local holder
    holder="$(tr -d ' ' <"/tmp/.X$dpy-lock" 2>/dev/null || true)"
    if [ -n "$holder" ] && kill -0 "$holder" 2>/dev/null; then die "display :$dpy is in use (pid $holder)"; fi
    rm -f "/tmp/.X$dpy-lock" "/tmp/.X11-unix/X$dpy"
  fi
  # A user's Xvfb cannot create X's socket directory: make it as x11-common does (/tmp may be fresh).
  [ -d /tmp/.X11-unix ] || [ "$(id -u)" != 0 ] || install -d -m 1777 /tmp/.X11-unix
  local work
  work="$(mktemp -d /tmp/dart-x-check.XXXXXX)"
  chmod 755 "$work"
  mkdir -p "$work/home"
  # As user nobody where root can switch to it (the project runs the desktop so).
  local as=()
  if [ "$(id -u)" = 0 ] && id nobody >/dev/null 2>&1; then
    if command -v setpriv >/dev/null; then
      as=(setpriv --reuid="$(id -u nobody)" --regid="$(id -g nobody)" --clear-groups)
    elif command -v runuser >/dev/null; then
      as=(runuser -u nobody --)
    fi
    [ ${#as[@]} -eq 0 ] || chown "$(id -u nobody):$(id -g nobody)" "$work/home"
  fi
  if [ ${#as[@]} -gt 0 ]; then echo "running the desktop as nobody (${as[0]})"; else echo "running the desktop as $(id -un)"; fi
  local envv=(env -i "PATH=$PATH" "HOME=$work/home" "DISPLAY=:$dpy" "LANG=${LANG:-C.UTF-8}" "TERM=xterm"
    NO_AT_BRIDGE=1 GSETTINGS_BACKEND=keyfile)
  pids=() names=()
  trap "check_cleanup '$work' '$dpy'" EXIT
  fail() {
    echo "check FAILED: $*" >&2
    local f
    for f in "$work"/*.log; do echo "--- $(basename "$f") (last lines)" >&2; tail -15 "$f" >&2; done
    exit 1
  }
  start() {  # NAME COMMAND...: in the background, as the desktop user, logging to NAME.log
    local name="$1"
    shift
    "${as[@]}" "${envv[@]}" "$@" </dev/null >"$work/$name.log" 2>&1 &
    pids+=("$!")
    names+=("$name")
  }
  alive() {
    local i
    for i in "${!pids[@]}"; do kill -0 "${pids[$i]}" 2>/dev/null || fail "${names[$i]} (pid ${pids[$i]}) exited"; done
  }
  local deadline=$((SECONDS + timeout))
  start xvfb Xvfb ":$dpy" -screen 0 1920x1080x24 -nolisten tcp
  until DISPLAY=":$dpy" xdotool getdisplaygeometry >"$work/geometry" 2>/dev/null; do
    alive
    [ $SECONDS -lt $deadline ] || fail "Xvfb :$dpy not answering after ${timeout}s"
    sleep 0.2
  done
  echo "Xvfb :$dpy up: $(cat "$work/geometry")"
  [ "$(cat "$work/geometry")" = "1920 1080" ] || fail "display geometry is $(cat "$work/geometry"), not 1920 1080"
  start openbox openbox
  sleep 1
  start xterm xterm
  start mousepad mousepad
  local found_xterm="" found_mousepad=""
  while :; do
    alive
    [ -n "$found_xterm" ] || found_xterm="$(DISPLAY=":$dpy" xdotool search --onlyvisible --name xterm 2>/dev/null | head -1 || true)"
    [ -n "$found_mousepad" ] || found_mousepad="$(DISPLAY=":$dpy" xdotool search --onlyvisible --name Mousepad 2>/dev/null | head -1 || true)"
    if [ -n "$found_xterm" ] && [ -n "$found_mousepad" ]; then break; fi
    [ $SECONDS -lt $deadline ] || fail "no visible window after ${timeout}s:${found_xterm:+ (xterm found)}${found_mousepad:+ (mousepad found)} ${found_xterm:-xterm missing} ${found_mousepad:-mousepad missing}"
    sleep 0.3
  done
  echo "windows: xterm $found_xterm \"$(DISPLAY=":$dpy" xdotool getwindowname "$found_xterm")\"," \
    "mousepad $found_mousepad \"$(DISPLAY=":$dpy" xdotool getwindowname "$found_mousepad")\""
  sleep 1
  alive
  echo "processes alive: ${names[*]} (pids ${pids[*]})"
  if ! command -v python3 >/dev/null; then
    echo "NOTICE: no python3 here: mss screenshot skipped"
  elif ! python3 -c 'import mss' 2>/dev/null; then
    echo "NOTICE: python3 has no mss here: screenshot skipped"
  else
    local size
    size="$(python3 -c 'import sys, mss
with mss.mss(display=sys.argv[1]) as s:
    shot = s.grab(s.monitors[0])
print(f"{shot.width}x{shot.height}")' ":$dpy")" || fail "mss screenshot failed"
    echo "mss screenshot of the root window: $size"
    [ "$size" = "1920x1080" ] || fail "screenshot is $size, not 1920x1080"
  fi
  alive
  echo "check OK: Xvfb, openbox, xterm and mousepad run on :$dpy"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  install) shift; install_bundle "$@" ;;
  check) shift; check "$@" ;;
  *) echo "usage: $0 prepare [OUTFILE] | install [FILE] | check" >&2; exit 2 ;;
esac
