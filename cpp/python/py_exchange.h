// PyExchange: jo::Exchange over a Python object (jaxoverlap._executors.bootstrap.StoreExchange)
// with attributes `process`, `processes` and methods `broadcast(tag, root, data|None) ->
// bytes` and `allgather(tag, data) -> {process: bytes}`. Header-only so that every
// nanobind module (_host, _cuda) can hand one to its C++ set-up code. Safe to call
// with or without the GIL held; Python exceptions become Status (a BootstrapError
// that names a silent process becomes kTimeout).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/exchange.h"

namespace jo::python {

class PyExchange : public Exchange {
 public:
  explicit PyExchange(nanobind::object impl) : impl_(std::move(impl)) {}
  ~PyExchange() override {
    nanobind::gil_scoped_acquire gil;
    impl_.reset();
  }

  int32_t process() const override {
    nanobind::gil_scoped_acquire gil;
    return nanobind::cast<int32_t>(impl_.attr("process"));
  }

  std::vector<int32_t> processes() const override {
    nanobind::gil_scoped_acquire gil;
    return nanobind::cast<std::vector<int32_t>>(impl_.attr("processes"));
  }

  Status Broadcast(const std::string& tag, int32_t root, std::string* data) override {
    nanobind::gil_scoped_acquire gil;
    try {
      nanobind::object in = nanobind::none();
      if (nanobind::cast<int32_t>(impl_.attr("process")) == root)
        in = nanobind::bytes(data->data(), data->size());
      nanobind::bytes out = nanobind::cast<nanobind::bytes>(impl_.attr("broadcast")(tag, root, in));
      data->assign(out.c_str(), out.size());
      return OkStatus();
    } catch (const nanobind::python_error& e) {
      return FromPython("broadcast '" + tag + "'", e);
    } catch (const nanobind::cast_error&) {
      return Internal("exchange broadcast '" + tag + "': the Python side did not return bytes");
    }
  }

  Status AllGather(const std::string& tag, const std::string& mine,
                   std::map<int32_t, std::string>* all) override {
    nanobind::gil_scoped_acquire gil;
    try {
      nanobind::dict out = nanobind::cast<nanobind::dict>(
          impl_.attr("allgather")(tag, nanobind::bytes(mine.data(), mine.size())));
      all->clear();
      for (auto item : out) {
        nanobind::bytes value = nanobind::cast<nanobind::bytes>(item.second);
        (*all)[nanobind::cast<int32_t>(item.first)] = std::string(value.c_str(), value.size());
      }
      return OkStatus();
    } catch (const nanobind::python_error& e) {
      return FromPython("allgather '" + tag + "'", e);
    } catch (const nanobind::cast_error&) {
      return Internal("exchange allgather '" + tag +
                      "': the Python side did not return "
                      "{process: bytes}");
    }
  }
  Status ShareFds(const std::string& tag, const std::vector<int>& fds,
                  std::map<int32_t, std::vector<int>>* got) override {
    nanobind::gil_scoped_acquire gil;
    got->clear();
    try {
      nanobind::dict out = nanobind::cast<nanobind::dict>(impl_.attr("share_fds")(tag, fds));
      for (auto item : out)
        (*got)[nanobind::cast<int32_t>(item.first)] = nanobind::cast<std::vector<int>>(item.second);
      return OkStatus();
    } catch (const nanobind::python_error& e) {
      return FromPython("share_fds '" + tag + "'", e);
    } catch (const nanobind::cast_error&) {
      return Internal("exchange share_fds '" + tag +
                      "': the Python side did not return "
                      "{process: [fd]}");
    }
  }

 private:
  static Status FromPython(const std::string& what, const nanobind::python_error& e) {
    const std::string text = e.what();
    const bool timeout = text.find("did not answer") != std::string::npos;
    return Status(timeout ? Code::kTimeout : Code::kInvalidArgument,
                  "exchange " + what + ": " + text);
  }

  nanobind::object impl_;
};

}  // namespace jo::python
