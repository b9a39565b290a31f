"""The capacity planner: a roofline model of prefill (compute-bound) and decode (bandwidth-bound) for deployments of
a model on a hardware spec, and the cheapest one that meets an SLO (`llmopt plan`)."""

from llmopt.planner.device_specs import HARDWARE, HardwareSpec, hardware_spec
from llmopt.planner.plan import Deployment, PlanWorkload, Prediction, Slo, plan_workload, predict, recommend
from llmopt.planner.shape import WEIGHT_SCHEMES, ModelShape, model_shape

__all__ = ["HARDWARE", "HardwareSpec", "hardware_spec", "Deployment", "PlanWorkload", "Prediction", "Slo",
           "plan_workload", "predict", "recommend", "WEIGHT_SCHEMES", "ModelShape", "model_shape"]
