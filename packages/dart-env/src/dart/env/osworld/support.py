"""What DART can run of OSWorld on each kind of VM: a *local desktop* (Xvfb + a terminal + a text editor)
or OSWorld's own VM image (docker, remote).

OSWorld runs each task in an Ubuntu VM with GNOME, Chrome, LibreOffice, GIMP, VS Code, VLC and
Thunderbird installed, a web proxy and the network. DART's local desktop is much smaller, so every
setup-step type, getter and metric the corpus uses is decided here by name, with a reason; a name
not listed is unsupported ("not in DART's support matrix"). Some decisions depend on the platform
(network, window tools, installed applications): :class:`LocalDesktop` probes the host once, with
:func:`shutil.which`; :class:`VMImage` declares what an OSWorld VM image has.

The same decisions, as features (``app:chrome``, ``step:execute``, ``getter:vm_file``,
``metric:exact_match``), are what an env pool reports it runs (:func:`provider_features`) and what a
task requires (:func:`task_requirements`): the data manager keeps the tasks whose requirements the pool's
features cover, exactly the tasks :func:`dart.env.osworld.audit.audit` finds runnable on that platform.
"""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Literal

from dart.env.osworld.config import OSWorldConfig
from dart.env.osworld.getters import BUILTIN_GETTERS
from dart.env.osworld.metrics import BUILTIN_METRICS
from dart.env.osworld.tasks import OSWorldTask

PROVIDED_APPS = frozenset({"terminal", "text_editor"})
"""Applications the local desktop backend itself brings (no probing)."""

APP_BINARIES: Mapping[str, Sequence[str]] = {
    "chrome": ("google-chrome", "chromium", "chromium-browser"),
    "libreoffice": ("soffice", "libreoffice"),
    "gimp": ("gimp",),
    "vscode": ("code",),
    "thunderbird": ("thunderbird",),
    "vlc": ("vlc",),
    "file_manager": ("nautilus",),
    "pdf_viewer": ("evince", "okular", "atril"),
    "image_viewer": ("eog", "ristretto", "feh"),
    "media_player": ("totem",),
    "picard": ("picard",),
}
"""Applications the local desktop does not bring, and the binaries that count as installed."""

RELATED_APP_NAMES: Mapping[str, str] = {
    "os": "terminal",
    "terminal": "terminal",
    "chrome": "chrome",
    "browser": "chrome",
    "libreoffice": "libreoffice",
    "libreoffice_calc": "libreoffice",
    "libreoffice calc": "libreoffice",
    "calc": "libreoffice",
    "libreoffice_writer": "libreoffice",
    "writer": "libreoffice",
    "libreoffice_impress": "libreoffice",
    "gimp": "gimp",
    "vscode": "vscode",
    "vs_code": "vscode",
    "thunderbird": "thunderbird",
    "vlc": "vlc",
    "ubuntu_media_player": "media_player",
    "pdf": "pdf_viewer",
    "image": "image_viewer",
    "picard": "picard",
}
"""OSWorld's free-form ``related_apps`` names (lower-cased) -> application."""

PROGRAM_APPS: Mapping[str, str] = {
    "google-chrome": "chrome",
    "chromium": "chrome",
    "libreoffice": "libreoffice",
    "soffice": "libreoffice",
    "gimp": "gimp",
    "code": "vscode",
    "thunderbird": "thunderbird",
    "vlc": "vlc",
    "nautilus": "file_manager",
}
"""A ``launch`` step's program -> the application it starts."""

_TEXT_SUFFIXES = frozenset(
    ".txt .md .py .json .yml .yaml .sh .tex .bib .html .css .js .log .ini .cfg .conf .c .h .cpp .java".split()
)
_SUFFIX_APPS: Mapping[str, str] = {
    **dict.fromkeys(".docx .doc .odt .xlsx .xls .ods .csv .pptx .ppt .odp".split(), "libreoffice"),
    **dict.fromkeys(".mp4 .mkv .avi .webm .mp3 .wav .ogg".split(), "vlc"),
    **dict.fromkeys(".png .jpg .jpeg .gif .webp .bmp .svg".split(), "image_viewer"),
    ".xcf": "gimp",
    ".pdf": "pdf_viewer",
    **dict.fromkeys(_TEXT_SUFFIXES, "text_editor"),
}

HOST_TOOLS = ("gsettings", "pactl", "pulseaudio", "timedatectl", "sudo", "xdotool", "wmctrl", "xsel", "xclip")
"""Desktop programs that, when a task's commands name them, must exist for the task to run."""

LAUNCHED_PROGRAMS = ("socat", "pkill", "python3", "python", "bash", "sh")
"""Other programs OSWorld tasks launch directly (``launch`` steps), looked up like the applications."""

OSWORLD_VM_APPS = frozenset({*PROVIDED_APPS, *APP_BINARIES, *HOST_TOOLS, *LAUNCHED_PROGRAMS})
"""What OSWorld's own VM image has (its Ubuntu desktop with every application its tasks use)."""
_HOST_TOOL_RE = re.compile(r"(?<![\w./-])(" + "|".join(map(re.escape, HOST_TOOLS)) + r")(?![\w-])")


@dataclass(frozen=True)
class Verdict:
    """Whether the local desktop supports one step type, getter or metric, and why."""

    supported: bool
    reason: str


@dataclass(frozen=True)
class LocalDesktop:
    """What the local desktop offers on this host.

    Attributes:
        network: Whether tasks may reach the internet (``download`` steps, ``cloud_file`` getters).
        which: How programs are looked up (:func:`shutil.which`; tests pass a fake).
    """

    network: bool = False
    which: Callable[[str], str | None] = shutil.which
    _found: dict[str, str | None] = field(default_factory=dict, compare=False, repr=False)

    def program(self, name: str) -> str | None:
        """The path of a program on this host, or None (looked up once)."""
        if name not in self._found:
            self._found[name] = self.which(name)
        return self._found[name]

    @property
    def window_tool(self) -> str | None:
        """``xdotool`` or ``wmctrl`` if installed (to raise, close and measure windows)."""
        return next((t for t in ("xdotool", "wmctrl") if self.program(t)), None)

    def app_path(self, app: str) -> str | None:
        """Where an application is: ``"provided"`` for the desktop's own apps, a binary path, or None."""
        if app in PROVIDED_APPS:
            return "provided"
        return next((p for b in APP_BINARIES.get(app, (app,)) if (p := self.program(b))), None)

    def app_names(self) -> tuple[str, ...]:
        """The applications and programs whose presence this platform reports (:func:`platform_features`)."""
        return (*sorted(PROVIDED_APPS), *APP_BINARIES, *HOST_TOOLS, *LAUNCHED_PROGRAMS)

    def probe(self) -> dict[str, str | None]:
        """Every application and host tool this audit considers, with where it was found."""
        apps: dict[str, str | None] = {a: self.app_path(a) for a in (*sorted(PROVIDED_APPS), *APP_BINARIES)}
        for tool in ("Xvfb", *HOST_TOOLS):
            apps[tool] = self.program(tool)
        return apps


@dataclass(frozen=True)
class VMImage:
    """What an OSWorld VM image offers (the docker and remote providers): its applications, a window tool
    (the VM server raises and closes windows), and the network where allowed.

    Attributes:
        apps: The applications and programs it has (OSWorld's image: :data:`OSWORLD_VM_APPS`).
        network: Whether tasks may reach the internet.
    """

    apps: frozenset[str] = OSWORLD_VM_APPS
    network: bool = False

    @property
    def window_tool(self) -> str | None:
        """The VM server's window routes."""
        return "the VM server"

    def app_path(self, app: str) -> str | None:
        """``"in the VM image"`` for an application it has, else None."""
        return "in the VM image" if app in self.apps else None

    def app_names(self) -> tuple[str, ...]:
        """The applications it has."""
        return tuple(sorted(self.apps))


Platform = LocalDesktop | VMImage
"""What a provider's VMs offer: a probed local desktop, or a declared VM image."""


# --- setup steps -------------------------------------------------------------------------------

_CDP = "drives Chrome over its remote-debugging port (Playwright); DART does not implement it"
_ACCOUNT = "needs a Google Drive / web account login with credentials; never available to DART"


def step_support(step_type: str, desktop: Platform) -> Verdict:
    """Whether a platform runs a setup-step type."""
    window = desktop.window_tool
    decisions: dict[str, Verdict] = {
        "launch": Verdict(True, "starts the program in the desktop session (the program must be installed)"),
        "execute": Verdict(True, "runs the command in the desktop session"),
        "command": Verdict(True, "runs the command in the desktop session"),
        "sleep": Verdict(True, "waits"),
        "upload_file": Verdict(True, "copies files from the host onto the desktop"),
        "open": Verdict(True, "opens the file with its default application (which must be available)"),
        "activate_window": Verdict(
            window is not None,
            f"raises a window by title with {window}" if window else "needs xdotool or wmctrl; neither is installed",
        ),
        "close_window": Verdict(
            window is not None,
            f"closes a window by title with {window}" if window else "needs xdotool or wmctrl; neither is installed",
        ),
        "download": Verdict(
            desktop.network,
            "fetches the task's files from their URLs"
            if desktop.network
            else "fetches files from the internet; this host runs without network",
        ),
        "chrome_open_tabs": Verdict(False, _CDP),
        "chrome_close_tabs": Verdict(False, _CDP),
        "update_browse_history": Verdict(False, "writes Chrome's history database; Chrome is not part of it"),
        "googledrive": Verdict(False, _ACCOUNT),
        "login": Verdict(False, _ACCOUNT),
    }
    return decisions.get(step_type, Verdict(False, "not in DART's support matrix"))


# --- getters -----------------------------------------------------------------------------------

_LOCAL_GETTERS: Mapping[str, str] = {
    "vm_file": "copies a file from the desktop's filesystem",
    "vm_command_line": "runs a shell command in the desktop session and takes its stdout",
    "vm_command_error": "runs a shell command in the desktop session and takes its stderr",
    "rule": "a literal value from the task file",
    "rule_relativeTime": "a value computed from the task file's rule and today's date",
    "cache_file": "a file an earlier step wrote into the task's cache directory",
    "list_directory": "lists a directory of the desktop's filesystem",
    "vm_screen_size": "the Xvfb screen size",
    "shortcuts_on_desktop": "lists the .desktop files in ~/Desktop",
}
_APP_GETTERS: Mapping[str, Sequence[str]] = {
    "Chrome state (tabs, profile, settings, extensions) over remote debugging": (
        "active_tab_html_parse active_tab_info active_tab_url_parse active_url_from_accessTree bookmarks"
        " chrome_font_size cookie_data data_delete_automacally default_search_engine enable_do_not_track"
        " enable_safe_browsing"
        " enabled_experiments find_installed_extension_name find_unpacked_extension_path history new_startup_page"
        " open_tabs_info page_info profile_name url_dashPart url_path_parse gotoRecreationPage_and_get_html_content"
    ).split(),
    "LibreOffice Impress slide content": ("audio_in_slide", "background_image_in_slide"),
    "VLC's configuration and playback state": ("vlc_config", "vlc_playing_info"),
    "GIMP's configuration files": ("gimp_config_file",),
    "VS Code's state (through its command palette)": ("vscode_config",),
    "GNOME desktop settings": ("vm_wallpaper", "default_video_player"),
}


def getter_support(getter_type: str, desktop: Platform) -> Verdict:
    """Whether a platform provides an evaluator getter."""
    if getter_type in _LOCAL_GETTERS and getter_type in BUILTIN_GETTERS:
        return Verdict(True, _LOCAL_GETTERS[getter_type])
    for what, names in _APP_GETTERS.items():
        if getter_type in names:
            return Verdict(False, f"reads {what}; DART does not implement this getter")
    window = desktop.window_tool
    decisions: dict[str, Verdict] = {
        "vm_window_size": Verdict(
            window is not None, f"measures a window with {window}" if window else "needs xdotool or wmctrl"
        ),
        "cloud_file": Verdict(
            desktop.network,
            "downloads the reference file" if desktop.network else "downloads the reference file; no network here",
        ),
        "info_from_website": Verdict(False, "scrapes a live website with a browser"),
        "pdf_from_url": Verdict(False, "prints a live web page to PDF with a browser"),
        "googledrive_file": Verdict(False, _ACCOUNT),
        "vm_terminal_output": Verdict(
            False, "reads GNOME Terminal's text through the accessibility tree; the local terminal exposes none"
        ),
        "accessibility_tree": Verdict(False, "needs the AT-SPI accessibility tree; the local desktop exposes none"),
        "content_from_vm_file": Verdict(False, "parses office documents (xlsx) with pandas; not a local dependency"),
    }
    return decisions.get(getter_type, Verdict(False, "not in DART's support matrix"))


# --- metrics -----------------------------------------------------------------------------------

_METRIC_REASONS: Mapping[str, str] = {
    "infeasible": "scored from the agent's final action: the task is solved by answering FAIL",
    "run_sqlite3": "queries an SQLite file with the standard library",
    "check_python_file_by_test_suite": "imports the task's Python files and runs its test function",
}
"""Why a built-in metric is supported, where it is not a plain comparison."""

_FORMAT_METRICS: Mapping[str, Sequence[str]] = {
    "Word documents (python-docx)": (
        "compare_docx_files compare_docx_tables compare_docx_images compare_docx_files_and_ignore_new_lines"
        " compare_line_spacing compare_font_names compare_subscript_contains compare_references fuzzy_place_math"
        " has_page_numbers_in_footers check_italic_font_size_14 evaluate_strike_through_last_paragraph"
        " evaluate_colored_words_in_tables is_first_line_centered find_default_font contains_page_break check_tabstops"
        " check_highlighted_words compare_unique_train_records"
    ).split(),
    "spreadsheets (openpyxl/pandas)": ("compare_table", "compare_conference_city_in_order"),
    "presentations (python-pptx)": (
        "compare_pptx_files check_slide_orientation_Portrait check_presenter_console_disable check_page_number_colors"
        " check_left_panel check_auto_saving_time check_image_stretch_and_center check_transition"
        " evaluate_presentation_fill_to_rgb_distance check_textbox_on_leftside"
    ).split(),
    "PDFs and e-books": ("compare_pdfs", "compare_pdf_images", "check_pdf_pages", "compare_epub"),
    "images (Pillow/scikit-image)": (
        "compare_images compare_image_list compare_image_text check_image_size check_image_file_size"
        " check_structure_sim check_structure_sim_resized check_brightness_decrease_and_structure_sim"
        " check_contrast_increase_and_structure_sim check_saturation_increase_and_structure_sim"
        " check_palette_and_structure_sim check_file_exists_and_structure_sim check_green_background"
        " check_image_mirror check_triangle_position"
    ).split(),
    "audio and video (librosa/OpenCV)": ("compare_audios", "compare_videos", "check_mp3_meta"),
    "archives whose members need format-specific metrics": ("compare_archive", "compare_zip_files"),
    "HTML pages (BeautifulSoup)": ("compare_htmls",),
}
_APP_METRICS: Mapping[str, Sequence[str]] = {
    "Chrome": (
        "is_expected_url_pattern_match is_expected_active_tab is_expected_active_tab_approximate is_expected_tabs"
        " is_expected_bookmarks is_expected_search_query is_extension_installed is_expected_installed_extensions"
        " is_cookie_deleted check_history_deleted check_enabled_experiments check_font_size is_shortcut_on_desktop"
        " is_added_to_steam_cart"
    ).split(),
    "GIMP": ("check_config_status",),
    "VLC": (
        "is_vlc_playing is_vlc_recordings_folder is_vlc_fullscreen check_qt_slider_colours check_qt_bgcone"
        " check_qt_minimal_view check_qt_max_volume check_one_instance_when_started_from_file"
        " check_global_key_play_pause"
    ).split(),
    "Thunderbird": ("check_thunderbird_prefs", "check_thunderbird_folder", "check_thunderbird_filter"),
    "the accessibility tree": ("check_accessibility_tree",),
}


def metric_support(func: str) -> Verdict:
    """Whether DART scores a metric on the local desktop: exactly the metrics DART implements
    (:data:`dart.env.osworld.metrics.BUILTIN_METRICS`), so the audit never claims one that is not."""
    if func in BUILTIN_METRICS:
        return Verdict(
            True, _METRIC_REASONS.get(func, "compares strings, lists, JSON or text files with the standard library")
        )
    if func == "is_in_vm_clickboard":
        return Verdict(False, "reads the X clipboard, which the local desktop does not expose")
    for what, names in _FORMAT_METRICS.items():
        if func in names:
            return Verdict(False, f"parses {what}; those libraries are not local-desktop dependencies")
    for what, names in _APP_METRICS.items():
        if func in names:
            return Verdict(False, f"inspects {what} state; not part of the local desktop")
    return Verdict(False, "not in DART's support matrix")


# --- applications a task needs -----------------------------------------------------------------


def _program_of(command: object) -> str | None:
    """The program a ``launch`` command starts (skipping ``VAR=value`` prefixes)."""
    if isinstance(command, list):
        words = [str(w) for w in command]
    elif isinstance(command, str):
        try:
            words = shlex.split(command)
        except ValueError:
            words = command.split()
    else:
        return None
    words = [w for w in words if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w)]
    return PurePosixPath(words[0]).name if words else None


def _app_of_path(path: str) -> str:
    suffix = PurePosixPath(path).suffix.lower()
    if not suffix:
        return "file_manager"  # OSWorld opens directories in the file manager
    return _SUFFIX_APPS.get(suffix, f"unknown file type {suffix}")


def _command_texts(task: OSWorldTask) -> Iterable[str]:
    for step in task.setup_steps:
        if step.type in ("execute", "command", "launch"):
            yield str(step.parameters.get("command", ""))
    for getter in task.evaluator.getters:
        if getter.type in ("vm_command_line", "vm_command_error"):
            yield str(getter.params.get("command", ""))


def required_apps(task: OSWorldTask) -> set[str]:
    """Applications and host programs a task needs: its related apps, what its steps launch and open,
    and the desktop tools (gsettings, sudo ...) its commands name."""
    apps = {RELATED_APP_NAMES.get(a.lower(), a.lower()) for a in task.related_apps}
    for step in task.setup_steps:
        if step.type == "launch" and (prog := _program_of(step.parameters.get("command"))):
            apps.add(PROGRAM_APPS.get(prog, prog))
        elif step.type == "open" and isinstance(path := step.parameters.get("path"), str):
            apps.add(_app_of_path(path))
    for text in _command_texts(task):
        apps.update(_HOST_TOOL_RE.findall(text))
    return apps


# --- features: what a platform runs, what a task requires --------------------------------------

STEP_TYPES = (
    "launch execute command sleep upload_file open activate_window close_window download chrome_open_tabs"
    " chrome_close_tabs update_browse_history googledrive login"
).split()
"""Every setup-step type the support matrix decides."""
GETTER_TYPES = tuple(
    dict.fromkeys(
        [*_LOCAL_GETTERS, *(n for names in _APP_GETTERS.values() for n in names), *BUILTIN_GETTERS]
        + "vm_window_size cloud_file info_from_website pdf_from_url googledrive_file vm_terminal_output".split()
        + ["accessibility_tree", "content_from_vm_file"]
    )
)
"""Every getter type the support matrix decides."""


def platform_features(platform: Platform) -> frozenset[str]:
    """What a platform runs, as task requirements: ``app:<name>`` for each application it has,
    ``step:``/``getter:``/``metric:`` for each supported setup step, getter and metric."""
    features = {f"app:{a}" for a in platform.app_names() if platform.app_path(a) is not None}
    features.update(f"step:{s}" for s in STEP_TYPES if step_support(s, platform).supported)
    features.update(f"getter:{g}" for g in GETTER_TYPES if getter_support(g, platform).supported)
    features.update(f"metric:{m}" for m in BUILTIN_METRICS if metric_support(m).supported)
    return frozenset(features)


def provider_platform(config: OSWorldConfig) -> Platform:
    """The platform an osworld env's provider gives: this host's desktop (``local``, probed) or the VM
    image (``docker``, ``remote``: OSWorld's, or the configured ``vm_apps``)."""
    if config.provider == "local":
        return LocalDesktop(network=config.network)
    apps = frozenset(config.vm_apps) if config.vm_apps is not None else OSWORLD_VM_APPS
    return VMImage(apps=apps, network=config.network)


def provider_features(config: OSWorldConfig) -> frozenset[str]:
    """What an osworld env with this config runs (:func:`platform_features` of :func:`provider_platform`)."""
    return platform_features(provider_platform(config))


def audit_platform(provider: Literal["local", "docker", "remote"], *, network: bool = False) -> Platform:
    """The platform ``dart env osworld-audit --provider`` audits against (docker and remote: OSWorld's VM)."""
    return LocalDesktop(network=network) if provider == "local" else VMImage(network=network)


def task_requirements(task: OSWorldTask) -> tuple[str, ...]:
    """What a task requires, as features: its setup steps (``config`` and ``postconfig``), getters, metrics
    and applications (:func:`required_apps`), sorted."""
    needs = {f"step:{s.type}" for s in task.setup_steps}
    needs.update(f"getter:{g.type}" for g in task.evaluator.getters)
    needs.update(f"metric:{m}" for m in task.evaluator.funcs)
    needs.update(f"app:{a}" for a in required_apps(task))
    return tuple(sorted(needs))
