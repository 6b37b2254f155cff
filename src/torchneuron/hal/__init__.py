"""The ground floor: the IREE HAL devices behind the neuron devices
(devices.py) and what a device index is (index.py)."""
