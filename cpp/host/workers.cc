#include "host/workers.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

namespace jo::host {
namespace {

class Workers {
 public:
  Status Post(std::function<void()> task) {
    std::unique_lock<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
    // Every queued task must have an idle worker of its own: a worker that
    // is busy may stay busy indefinitely (it may be running XLA's
    // continuation, blocked in an XLA collective that waits for this task).
    if (tasks_.size() <= static_cast<size_t>(idle_)) {
      lock.unlock();
      cv_.notify_one();
      return OkStatus();
    }
    try {
      std::thread([this] { Loop(); }).detach();
    } catch (const std::system_error& e) {
      tasks_.pop_back();
      return Status(Code::kResource, std::string("could not start a worker thread: ") + e.what());
    }
    return OkStatus();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (tasks_.empty()) {
        ++idle_;
        const bool got =
            cv_.wait_for(lock, std::chrono::seconds(30), [&] { return !tasks_.empty(); });
        --idle_;
        if (!got) return;
      }
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      task = nullptr;  // destroy captures outside the lock
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  int idle_ = 0;
};

Workers& Pool() {
  static Workers* pool = new Workers;  // never destroyed: detached workers may outlive main
  return *pool;
}

}  // namespace

Status PostToWorker(std::function<void()> task) { return Pool().Post(std::move(task)); }

}  // namespace jo::host
