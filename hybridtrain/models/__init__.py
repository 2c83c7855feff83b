"""Model zoo: ResNets with torchvision-compatible names and the paper's initialisation.

May import: distributed, config, errors.
"""
from hybridtrain.models.resnet import STAGES, ResNet, create_model, kaiming_fan_in_std, model_from_config, xavier_std

__all__ = ["STAGES", "ResNet", "create_model", "kaiming_fan_in_std", "model_from_config", "xavier_std"]
