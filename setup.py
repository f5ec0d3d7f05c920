"""Ships ``het_plugin_megatron.pth`` and ``het_plugin_deepspeed.pth`` into site-packages (everything else is in
pyproject.toml).

The first registers het_plugin's Megatron-LM import hook (het_plugin/megatron/hook.py) only when
``--heterogeneous-nic`` is on the command line; otherwise it imports nothing. The second puts a one-lambda finder
on sys.meta_path that imports het_plugin's DeepSpeed hook (het_plugin/deepspeed/hook.py) only when a module named
``deepspeed`` is imported; otherwise it imports nothing either. setuptools has no declarative way to
put a file at the top of site-packages, so build_py copies it next to the packages (wheels, sdists)
and editable installs add it to the editable wheel.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "het_plugin_megatron.pth"
# One line, run by Python's site module at every interpreter start-up, so it does the least possible: unless
# --heterogeneous-nic is on the command line (and HET_PLUGIN_NO_HOOK is unset or 0) it imports nothing (os and
# sys are loaded already); with the flag it loads the hook, which the same test guards (hook._flag_on).
# Harmless if het_plugin was removed.
PTH_TEXT = ('import os, sys; os.environ.get("HET_PLUGIN_NO_HOOK", "") in ("", "0") and '
            'any(a == "--heterogeneous-nic" or a.startswith("--heterogeneous-nic=") for a in getattr(sys, "argv", ())[1:]) '
            'and __import__("importlib.util").util.find_spec("het_plugin") is not None and '
            '__import__("het_plugin.megatron.hook", fromlist=["install"]).install()\n')

DS_PTH = "het_plugin_deepspeed.pth"
# One line, no import: a finder whose find_spec answers None for every module but "deepspeed"; for that one (if
# het_plugin is still installed) it hands over to het_plugin.deepspeed.hook.from_trigger, which removes the finder,
# patches DeepSpeed once it has loaded, and reads HET_PLUGIN_NO_HOOK.
DS_PTH_TEXT = ('import sys; sys.meta_path.insert(0, type("HetPluginDeepSpeedTrigger", (), {"find_spec": '
               'lambda self, name, path=None, target=None: __import__("het_plugin.deepspeed.hook", '
               'fromlist=["from_trigger"]).from_trigger(self, name, path, target) if name == "deepspeed" and '
               '__import__("importlib.util").util.find_spec("het_plugin") is not None else None})())\n')
PTHS = {PTH: PTH_TEXT, DS_PTH: DS_PTH_TEXT}


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        Path(self.build_lib).mkdir(parents=True, exist_ok=True)
        for name, text in PTHS.items():
            Path(self.build_lib, name).write_text(text)
        # `het-plugin patch` finds the Megatron-LM patches inside the installed package.
        patches = Path(__file__).resolve().parent / "patches"
        if patches.is_dir() and not getattr(self, "editable_mode", False):
            for src in patches.rglob("*.patch"):
                dst = Path(self.build_lib, "het_plugin", "_patches", src.relative_to(patches))
                dst.parent.mkdir(parents=True, exist_ok=True)
                self.copy_file(str(src), str(dst), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return list(super().get_outputs(include_bytecode)) + [str(Path(self.build_lib, name)) for name in PTHS]


cmdclass = {"build_py": BuildPyWithPth}

try:  # setuptools >= 64 (PEP 660 editable installs)
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, name, tag, build_lib):
            strategy = super()._select_strategy(name, tag, build_lib)

            class WithPth:
                def __enter__(self):
                    strategy.__enter__()
                    return self

                def __exit__(self, *exc):
                    return strategy.__exit__(*exc)

                def __call__(self, wheel, files, mapping):
                    strategy(wheel, [f for f in files if not f.endswith(tuple(PTHS))],
                             {k: v for k, v in mapping.items() if not k.endswith(tuple(PTHS))})
                    for name, text in PTHS.items():
                        wheel.writestr(name, text)

            return WithPth()

    cmdclass["editable_wheel"] = EditableWheelWithPth
except ImportError:
    pass

setup(cmdclass=cmdclass)
