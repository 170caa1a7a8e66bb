"""The cost model (docs/design.md, "Cost model"): what a decode of n rows costs on one loaded
model, as decisions see it (curve), how it is calibrated (calibration), what a curve can be
(shape), and the disk cache (store). How busy other work kept the cores is flylocal.host's `CpuLoad`."""

from flylocal.decoding.costs.calibration import BUDGET, CALIBRATION_SIZES
from flylocal.decoding.costs.curve import EXPLORE, STALE, SWITCH_PRIOR, WAIT, CostCurve, Source, State
from flylocal.decoding.costs.store import read_file, read_record
from flylocal.host import costs_dir

__all__ = ["BUDGET", "CALIBRATION_SIZES", "EXPLORE", "STALE", "SWITCH_PRIOR", "WAIT", "CostCurve", "Source", "State",
           "costs_dir", "read_file", "read_record"]
