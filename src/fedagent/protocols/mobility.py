"""Vehicle mobility and motion blur (FLSimCo, Gu et al.; shared/seeds/001), pure numpy.

Speed model (eq. 1): a vehicle's speed ``v`` follows a Gaussian N(μ, σ²) truncated to
``[v_min, v_max]``::

    f(v) = exp(-(v-μ)²/(2σ²)) / ( sqrt(2πσ²) · [erf((v_max-μ)/(σ√2)) - erf((v_min-μ)/(σ√2))] )

on the support and 0 elsewhere. The paper writes the normaliser with erf and no factor
½; the density then integrates to ½, so the ``½`` of Φ(x) = ½(1 + erf(x/√2)) is put
back here (``truncated_gaussian_pdf`` integrates to 1, checked by a test). Samples come
from the inverse CDF, so every one lies in the support.

Blur level (eq. 2): ``L = (H s / Q) v`` with H the exposure time, s the focal length
and Q the pixel size; L is a length in pixels. A vehicle's images are smeared by a
linear motion-blur kernel of that length along the direction of travel (horizontal).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

_STANDARD = NormalDist()


def _ndtr(x: float) -> float:
    """Φ(x), the standard normal CDF; erfc keeps its precision in the lower tail."""
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _inv(q: float) -> float:
    if q <= 0.0:
        return -math.inf
    if q >= 1.0:
        return math.inf
    return _STANDARD.inv_cdf(q)


def _ndtri(p: np.ndarray) -> np.ndarray:
    """Φ⁻¹ elementwise (Wichura's AS241, accurate to about 1e-16), ±inf at 0 and 1."""
    return np.array([_inv(float(q)) for q in p.ravel()], dtype=np.float64).reshape(p.shape)


def _check(mu: float, sigma: float, v_min: float, v_max: float) -> None:
    if not (sigma > 0 and math.isfinite(mu) and v_min < v_max):
        raise ValueError(f"need sigma > 0 and v_min < v_max, got mu={mu}, sigma={sigma}, v_min={v_min}, v_max={v_max}")


def truncated_gaussian_pdf(v: np.ndarray | float, mu: float, sigma: float, v_min: float, v_max: float) -> np.ndarray:
    """Eq. 1 (normalised to integrate to 1; see the module docstring)."""
    _check(mu, sigma, v_min, v_max)
    v = np.asarray(v, dtype=np.float64)
    z = 0.5 * (math.erf((v_max - mu) / (sigma * math.sqrt(2))) - math.erf((v_min - mu) / (sigma * math.sqrt(2))))
    dens = np.exp(-((v - mu) ** 2) / (2 * sigma**2)) / (math.sqrt(2 * math.pi * sigma**2) * z)
    return np.where((v >= v_min) & (v <= v_max), dens, 0.0)


def sample_speeds(n: int, mu: float, sigma: float, v_min: float, v_max: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` independent speeds from eq. 1, by inverting the truncated CDF."""
    _check(mu, sigma, v_min, v_max)
    lo, hi = _ndtr((v_min - mu) / sigma), _ndtr((v_max - mu) / sigma)
    u = rng.uniform(lo, hi, size=n)
    return np.clip(mu + sigma * _ndtri(u), v_min, v_max)


def truncated_gaussian_moments(mu: float, sigma: float, v_min: float, v_max: float) -> tuple[float, float]:
    """Mean and variance of eq. 1 in closed form (to check the sampler against)."""
    _check(mu, sigma, v_min, v_max)
    a, b = (v_min - mu) / sigma, (v_max - mu) / sigma
    phi = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    z = _ndtr(b) - _ndtr(a)
    mean = mu + sigma * (phi(a) - phi(b)) / z
    var = sigma**2 * (1 + (a * phi(a) - b * phi(b)) / z - ((phi(a) - phi(b)) / z) ** 2)
    return mean, var


def blur_level(speed: float, *, exposure: float, focal: float, pixel: float) -> float:
    """Eq. 2: ``L = (H s / Q) v``."""
    if not (exposure > 0 and focal > 0 and pixel > 0 and speed >= 0):
        raise ValueError("exposure, focal length and pixel size must be positive, speed non-negative")
    return exposure * focal / pixel * speed


def motion_blur_kernel(length: float) -> np.ndarray:
    """A normalised horizontal line kernel covering ``length`` pixels (≥ 1).

    Full pixels weigh 1, the fractional remainder is split over the two ends, so the
    kernel's first moment grows continuously with ``length``; ``length ≤ 1`` is the
    identity (a sharp image)."""
    if not (math.isfinite(length) and length >= 0):
        raise ValueError(f"blur length must be finite and non-negative, got {length}")
    if length <= 1:
        return np.ones(1)
    full = int(math.floor(length))
    frac = length - full
    if full % 2 == 0:  # keep the kernel odd-sized and centred
        full -= 1
        frac += 1
    k = np.ones(full + 2)
    k[0] = k[-1] = frac / 2
    if frac == 0:
        k = k[1:-1]
    return k / k.sum()


def blur_images(images: np.ndarray, length: float) -> np.ndarray:
    """Smear ``images`` (N, H, W) along the rows with :func:`motion_blur_kernel`; the
    edge pixels are repeated (a camera sees the scene continue past the frame)."""
    k = motion_blur_kernel(length)
    if k.size == 1:
        return images.astype(np.float32, copy=True)
    r = k.size // 2
    padded = np.pad(images.astype(np.float64), ((0, 0), (0, 0), (r, r)), mode="edge")
    out = np.zeros(images.shape, dtype=np.float64)
    for i, w in enumerate(k):
        out += w * padded[:, :, i : i + images.shape[2]]
    return out.astype(np.float32)
