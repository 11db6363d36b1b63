"""The models: the contracts every model meets (`base`), the registry (`registry`), the pieces several systems
share (`encoders`, `region_word`, `losses`), and one package per system (scan with VSE++ and Sum-Max, oan, mmca,
save, sman, and the worked example meanpool). Every subpackage is imported here, and registers its archs,
options and presets as it is: a new model is a new package, with no edit outside it (docs/architecture.md)."""

import importlib
import pkgutil

for _package in pkgutil.iter_modules(__path__):
    if _package.ispkg:
        importlib.import_module(f"{__name__}.{_package.name}")
